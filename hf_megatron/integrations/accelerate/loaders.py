"""DataLoaders for the Megatron-LM engine, as accelerate's Megatron-LM integration prepares them,
plus the position a checkpoint needs to continue exactly.

Sharding: over the *data-parallel* ranks only (the TP and PP ranks of one model replica read
the same batches, in the same shuffle: under MEGATRON_LM accelerate synchronises the shuffle
generator even at dp = 1), `even_batches` as accelerate does it at dp > 1 (at dp = 1 the short last
batch stays short, as plain accelerate with one process yields it).  Batch size: micro_batch_size x
num_micro_batches samples per dp rank per step (see plugin.py for micro_batch_size).

Position.  accelerate draws each epoch's shuffle from a generator synchronised over the ranks at
the start of every pass.  `PositionedLoader` records that generator's state when a pass starts
and counts the batches it yields; `position()` is what `save_state` stores and `restore()`
what `load_state` puts back: the generator as it was at the start of the interrupted pass (or
after a finished one) and the pass number.  The next pass then yields the same batches in the
same order; skipping the ones already trained on stays the script's business, as in
accelerate (`accelerator.skip_first_batches`, or the example scripts' own skip).
"""
from __future__ import annotations

from typing import Any

import torch
from accelerate.data_loader import DataLoaderShard, prepare_data_loader
from accelerate.utils.dataclasses import DataLoaderConfiguration

from ...errors import ConfigError
from ...parallel import state

_LOADER_KWARGS = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "prefetch_factor",
                  "persistent_workers", "generator", "multiprocessing_context")


class PassSeededSampler(torch.utils.data.RandomSampler):
    """A shuffling sampler at dp 1, as plain accelerate's one process leaves torch's RandomSampler
    (no generator: each pass draws its seed from the user's torch generator, after the loader's own
    base-seed draw), so set_seed gives plain accelerate's order; the first rank's seed serves every
    rank (the tp / pp ranks of the one replica read the same batches).  `pass_start`: the generator
    as the current pass seeded it; `resume_state`: a checkpoint's mid-pass state for the next pass."""

    pass_start: torch.Tensor | None = None
    resume_state: torch.Tensor | None = None

    @classmethod
    def of(cls, sampler: torch.utils.data.RandomSampler) -> "PassSeededSampler":
        return cls(sampler.data_source, replacement=sampler.replacement, num_samples=sampler._num_samples,
                   generator=torch.Generator())

    def __iter__(self):
        if self.resume_state is not None:
            self.generator.set_state(self.resume_state)
            self.resume_state = None
        else:
            seed = [int(torch.empty((), dtype=torch.int64).random_().item())]  # torch's RandomSampler's draw
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.broadcast_object_list(seed, src=0)
            self.generator.manual_seed(seed[0])
        self.pass_start = self.generator.get_state()
        yield from super().__iter__()


class PositionedLoader(DataLoaderShard):
    """accelerate's DataLoaderShard that remembers where its current pass is."""

    _pass_index: int | None = None          # `iteration` (pass number) when the current pass began
    _pass_start: torch.Tensor | None = None  # shuffle generator state then
    _yielded = 0
    _pass_sampler = None                     # a PassSeededSampler (dp 1 shuffle), or None

    def __iter__(self):
        generator = self.synchronized_generator
        self._pass_index, self._yielded = self.iteration, 0
        self._pass_start = generator.get_state() if generator is not None else None
        for batch in super().__iter__():
            self._yielded += 1
            yield batch

    def position(self) -> dict[str, Any]:
        generator = self.synchronized_generator
        current = generator.get_state() if generator is not None else None
        if self._pass_index is None:  # never iterated
            return {"pass": self.iteration, "batches": 0, "generator_state": current}
        if self._yielded >= self._length():
            # the pass is done, even if the loop has not left it yet: accelerate fetches one batch
            # ahead, so the sampler is exhausted and the generator holds every draw of this pass
            # (torch's RandomSampler draws once more on exhaustion)
            return {"pass": self._pass_index + 1, "batches": 0, "generator_state": current}
        start = self._pass_start
        if isinstance(self._pass_sampler, PassSeededSampler) and self._pass_sampler.pass_start is not None:
            start = self._pass_sampler.pass_start  # seeded as the pass began, not at __iter__
        return {"pass": self._pass_index, "batches": self._yielded, "generator_state": start}

    def _length(self) -> float:
        try:
            return len(self)
        except TypeError:  # an IterableDataset: no length, the pass ends when it ends
            return float("inf")

    def restore(self, saved: dict[str, Any]) -> None:
        if saved.get("generator_state") is not None and self.synchronized_generator is not None:
            self.synchronized_generator.set_state(saved["generator_state"])
            if isinstance(self._pass_sampler, PassSeededSampler) and int(saved.get("batches") or 0) > 0:
                self._pass_sampler.resume_state = saved["generator_state"]  # that pass's order again
        self.iteration = int(saved["pass"])


def prepare_loader(loader: torch.utils.data.DataLoader, batch_size: int, device, rng_types,
                   config: DataLoaderConfiguration):
    """A DataLoader -> its dp-sharded accelerate loader, batch_size samples per dp rank."""
    if loader.batch_size is None:
        raise ValueError("accelerator.prepare (Megatron-LM): a DataLoader with a custom batch_sampler is not "
                         "supported; give it batch_size=micro batch size")
    kwargs = {k: getattr(loader, k) for k in _LOADER_KWARGS if hasattr(loader, k)}
    if kwargs.get("num_workers", 0) == 0:
        kwargs.pop("prefetch_factor", None), kwargs.pop("persistent_workers", None)
    if config.dispatch_batches:
        raise ConfigError("DataLoaderConfiguration(dispatch_batches=True) is not supported under Megatron-LM: the main "
                          "process would deal different batches to the tensor / pipeline ranks of one model; leave it "
                          "unset (each data-parallel rank reads its own share, an IterableDataset too)")
    iterable = isinstance(loader.dataset, torch.utils.data.IterableDataset)
    sampler = {} if iterable else {"sampler": loader.sampler}  # torch refuses a sampler with an IterableDataset
    if (state.get_state().dp == 1 and type(loader.sampler) is torch.utils.data.RandomSampler
            and loader.sampler.generator is None and not config.use_seedable_sampler):
        sampler["sampler"] = PassSeededSampler.of(loader.sampler)  # no draw at prepare (plain accelerate's 1 process)
    rebuilt = torch.utils.data.DataLoader(loader.dataset, batch_size=batch_size, drop_last=loader.drop_last,
                                          **sampler, **kwargs)
    grid = state.get_state()
    # even_batches evens out the dp ranks' last batches (duplicating samples); with one dp rank there is nothing
    # to even out and plain accelerate with one process yields the short last batch as it is
    even_batches = config.even_batches and grid.dp > 1
    # dispatch_batches False: accelerate's default for an IterableDataset (True) would broadcast the world's main
    # process's batches over all ranks, each taking its slice -- the tp ranks of one replica would differ
    prepared = prepare_data_loader(rebuilt, device, num_processes=grid.dp, process_index=grid.rank_in("dp"),
                                   split_batches=False, put_on_device=True, rng_types=list(rng_types or []),
                                   dispatch_batches=False, even_batches=even_batches,
                                   use_seedable_sampler=config.use_seedable_sampler,
                                   non_blocking=config.non_blocking)
    if type(prepared) is DataLoaderShard:
        # same object, plus position() (module docstring).  DataLoaderShard's `__class__` is a
        # read-only property (it reports torch's DataLoader for isinstance checks, and still
        # does), so the type is set through object's own slot
        object.__dict__["__class__"].__set__(prepared, PositionedLoader)
        prepared._pass_sampler = sampler.get("sampler")
    return prepared
