import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # tests import shared helpers from tiny.py
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
