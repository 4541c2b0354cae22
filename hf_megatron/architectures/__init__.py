"""Per model family knowledge: config adapter, parallel plan, weight mapping, HF class names."""
from .plan import Shard, gpt_plan


def plan_for(config):
    """The parallel plan of config's architecture family."""
    return gpt_plan(config)
