"""Contiguous fp32 main-grad buffer in buckets, summed over dp (Megatron's `--overlap-grad-reduce`).

Layout.  This rank's params are laid out last chunk first, last param first -- roughly the
order in which backward produces their gradients -- in ONE flat fp32 buffer; every param's
`main_grad` is a view of it, its start aligned to `ALIGN` elements.  Consecutive params form a
bucket until it holds >= `bucket_size` elements (Megatron's `--ddp-bucket-size`, counted in
elements); a bucket never spans two model chunks or two param dtypes, and is padded to a
multiple of ALIGN x dp elements so that it splits into dp equal shards: shard r is elements
[r n / dp, (r + 1) n / dp) of the bucket.  Params in `alone` get a bucket of their own: the
word embedding tied across pipeline stages, whose two copies (first and last stage) are summed
over the embedding group after the dp reduction -- elementwise, so both stages' copies must be
sharded the same way (Megatron's rule for the shared embedding).

Accumulation.  Each micro batch's `p.grad` is added into `p.main_grad` and freed, so
main_grad = sum_m g_m   over this rank's micro batches, in fp32 (the loss was already scaled by
1 / N_global, see training/trainer.py, so no averaging follows).  Where a bucket must be reduced
during backward (`overlap` with dp > 1) a post-accumulate-grad hook per param does it the moment
the gradient lands (and counts, see below).  Otherwise the per-param hook only queues, once per
backward pass, a callback that the autograd engine runs when that backward ends: it adds all
gradients in one `_foreach_add_` and frees them.  Same adds (one per param and micro batch), the
same fp32 sums; but a Python call per param that launches a kernel, ~20 us of host time, keeps a
compiled layer's backward waiting on the host (GPT-2 medium: ~0.27 ms of GPU idle per layer), while
the deferred adds are queued behind the backward's kernels.  The price: a micro batch's bf16
gradients live until its backward ends (2 bytes per param, when the activations are freed).
With `--gradient-accumulation-fusion` (parallel/wgrad.py) a fused weight's GEMM has already
accumulated into main_grad and `p.grad` is a placeholder: it is only counted and freed.

Lazy allocation (`lazy=True`: one process, nothing to reduce).  With one backward per step the fp32
sum is the bf16 gradient itself, widened; so the buffer is not allocated until a step has a second
backward: the first one's gradients are set aside as autograd made them (`gradients()` returns
them; the optimizer widens them -- csrc's AdamW in registers, else one copy into fp32 at the
step, when the activations are gone), a second one allocates the buffer and
folds both, and from then on the buffer is used as above.  Saves 4 bytes per param of memory and
the fold's pass over them; the sums are the same numbers.

Reduction over the dp group, SUM:  `all_reduce` of the bucket, or with the distributed optimizer
`reduce_scatter`: dp rank r receives shard r of the summed bucket; the other elements keep this
rank's partial sums and are never read.  With `overlap=True` a bucket is launched (async) the
moment every param in it has fired its hook once per micro batch of the step -- i.e. in the
last micro batch -- while backward continues on earlier layers; `finish()` launches whatever did
not launch (params without a gradient) and waits for all.  Without overlap `finish()` launches
every bucket after backward.  Same buckets, same collectives, same elementwise sums: the two
modes give bit-identical gradients; only the timing moves.

Params as views (`shard_params=True`, the distributed optimizer): each bucket also owns a flat
buffer of the params' dtype and every `p.data` becomes a view of it, so the updated shards can
be all-gathered in place (`start_param_gather`), one collective per bucket.

Why not torch's DDP comm hooks / FSDP2: DDP's reducer reduces the param-dtype `.grad` (a comm
hook can make it a sum, even in fp32, but the result lands back in the bf16 `.grad`); micro batches under
`no_sync` would accumulate in bf16 `.grad` instead of the fp32 main grad; and its bucket layout is
private and rebuilt after the first iteration, so the distributed optimizer could not own fixed
contiguous shards of it.  FSDP2 shards the *parameters* (ZeRO-3: all-gather before every forward
and backward) -- more traffic than ZeRO-1, and a different optimizer-state layout than Megatron's.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import all_gather_flat, reduce_scatter_flat
from .wgrad import is_placeholder

ALIGN = 64  # elements: param starts and bucket sizes stay 256-byte aligned (vectorised kernels)
DEFAULT_BUCKET_SIZE = 40_000_000  # Megatron: max(40M, 1M x dp) elements


def default_bucket_size(dp: int) -> int:
    return max(DEFAULT_BUCKET_SIZE, 1_000_000 * dp)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def plan_buckets(chunks, params: list[torch.Tensor], dp: int, bucket_size: int, alone=()) -> list[tuple]:
    """The buffer layout (see the module docstring), computed from shapes only (meta tensors are
    fine): one (params, their offsets in the bucket, bucket start in the buffer, padded numel)
    per bucket."""
    wanted, alone = {id(p) for p in params}, {id(p) for p in alone}
    runs: list[list[torch.Tensor]] = []  # params in buffer order, split where the chunk or dtype changes
    seen: set[int] = set()
    for chunk in reversed(list(chunks)):
        run: list[torch.Tensor] = []
        for p in reversed(list(chunk.parameters())):
            if id(p) in wanted and id(p) not in seen:
                seen.add(id(p))
                if run and p.dtype != run[-1].dtype:
                    runs.append(run)
                    run = []
                run.append(p)
        if run:
            runs.append(run)
    if len(seen) != len(wanted):
        raise ValueError(f"GradBuffer: {len(wanted) - len(seen)} params are not in the given model chunks")
    plans, total = [], 0
    for run in runs:
        members, offsets, size = [], [], 0
        for i, p in enumerate(run):
            members.append(p)
            offsets.append(size)
            size = _round_up(size + p.numel(), ALIGN)
            last = i == len(run) - 1
            if size >= bucket_size or last or id(p) in alone or id(run[i + 1]) in alone:
                numel = _round_up(size, ALIGN * dp)
                plans.append((members, offsets, total, numel))
                total += numel
                members, offsets, size = [], [], 0
    return plans


class Bucket:
    """A run of params reduced by one collective: `grad` (fp32) and optionally `param_data`
    (the params' dtype) are views of length `numel` (padded); `offsets[i]` is params[i]'s start."""

    def __init__(self, params: list[torch.Tensor], offsets: list[int], numel: int, grad: torch.Tensor) -> None:
        self.params, self.offsets, self.numel, self.grad = params, offsets, numel, grad
        self.param_data: torch.Tensor | None = None
        self.grad_work = None  # async handle of the running reduction
        self.gather_work = None  # async handle of the running param all-gather
        self.launched = False
        self.ready = 0  # params whose hook fired for the last micro batch

    def shard_range(self, rank: int, size: int) -> tuple[int, int]:
        n = self.numel // size
        return rank * n, (rank + 1) * n

    def shard(self, tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        lo, hi = self.shard_range(rank, size)
        return tensor[lo:hi]


class GradBuffer:
    """fp32 main grads of `chunks`' params (`params` says which, in any order) in buckets; see the module docstring."""

    def __init__(self, chunks, params: list[torch.Tensor], group=None, bucket_size: int | None = None,
                 overlap: bool = False, reduce_scatter: bool = False, shard_params: bool = False,
                 alone: list[torch.Tensor] = (), lazy: bool = False) -> None:
        self.group = group
        self.dp = dist.get_world_size(group) if group is not None else 1
        self.dp_rank = dist.get_rank(group) if group is not None else 0
        self.overlap, self.reduce_scatter = overlap, reduce_scatter
        if lazy and (self.dp > 1 or shard_params):
            raise ValueError("GradBuffer: lazy allocation needs dp = 1 and unsharded params")
        self.plans = plan_buckets(chunks, params, self.dp, bucket_size or default_bucket_size(self.dp), alone)
        self._device = params[0].device if params else torch.device("cpu")
        self.data: torch.Tensor | None = None
        self.buckets: list[Bucket] = []
        self.bucket_of: dict[int, Bucket] = {}
        self.offset_of: dict[int, int] = {}  # id(p) -> its start inside its bucket
        self._params = [p for members, *_ in self.plans for p in members]
        self._stash: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # lazy: the step's one backward
        if not lazy:
            self._allocate(shard_params)
        self._left: dict[int, int] = {}  # id(p) -> hook firings still expected this step
        self.per_param = overlap and self.dp > 1  # reductions launched from inside backward
        self._fold_queued = False
        hook = self._accumulate if self.per_param else self._queue_fold
        self._hooks = [p.register_post_accumulate_grad_hook(hook) for p in self._params]

    def _allocate(self, shard_params: bool = False) -> None:
        """The fp32 buffer and every param's `main_grad` view (zeros)."""
        total = sum(numel for *_, numel in self.plans)
        self.data = torch.zeros(total, dtype=torch.float32, device=self._device)
        for members, offsets, start, numel in self.plans:
            bucket = Bucket(members, offsets, numel, self.data[start:start + numel])
            for p, offset in zip(members, offsets):
                p.main_grad = bucket.grad[offset:offset + p.numel()].view(p.shape)
                self.bucket_of[id(p)], self.offset_of[id(p)] = bucket, offset
            if shard_params:
                bucket.param_data = torch.zeros(numel, dtype=members[0].dtype, device=self._device)
                with torch.no_grad():
                    for p, offset in zip(members, offsets):
                        view = bucket.param_data[offset:offset + p.numel()].view(p.shape)
                        view.copy_(p)
                        p.data = view
            self.buckets.append(bucket)

    def gradients(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """This step's summed gradient of each of `params`: its fp32 `main_grad`, or -- lazy, one
        backward so far -- the gradient that backward produced (its own dtype; zeros for a param
        it did not reach)."""
        if self.data is not None:
            return [p.main_grad for p in params]
        stashed = {id(p): g for p, g in self._stash or ()}
        return [stashed[id(p)] if id(p) in stashed else torch.zeros_like(p) for p in params]

    # ------------------------------------------------------------- grads
    def zero(self, num_micro_batches: int | None = None) -> None:
        """Start a step: zero the buffer (one fill); with overlap, expect `num_micro_batches`
        hook firings per param before its bucket may be reduced (None: reduce in `finish`)."""
        self._wait_grads()  # a reduction still in flight must not land in the new step
        self._stash = None
        if self.data is not None:
            self.data.zero_()
        self._fold_queued = False  # a backward that raised never ran its fold
        for bucket in self.buckets:
            bucket.launched, bucket.ready = False, 0
        counting = self.per_param and num_micro_batches
        self._left = {id(p): num_micro_batches for b in self.buckets for p in b.params} if counting else {}

    def _accumulate(self, p: torch.Tensor) -> None:
        bucket = self.bucket_of[id(p)]
        if bucket.launched and self._left:  # counting: this bucket's sum is (being) reduced already
            raise RuntimeError("GradBuffer: a gradient arrived after its bucket's dp reduction started "
                               "(a param used more than once per micro batch outside one autograd graph?)")
        if not is_placeholder(p.grad):  # fused wgrad: the GEMM already accumulated into main_grad
            p.main_grad.add_(p.grad)
        p.grad = None
        left = self._left.get(id(p))
        if left is not None:
            self._left[id(p)] = left - 1
            if left == 1:
                bucket.ready += 1
                if bucket.ready == len(bucket.params):
                    self._launch(bucket)

    def _queue_fold(self, p: torch.Tensor) -> None:
        if not self._fold_queued:
            self._fold_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._fold)

    def _fold(self) -> None:
        """End of a backward pass: main_grad += grad for every param that got one, then free it.
        Lazy: the step's first backward only sets its gradients aside (exact: 0 + g = g in fp32);
        a second one allocates the buffer and folds both."""
        self._fold_queued = False
        arrived = [(p, g) for p in self._params if (g := p.grad) is not None]  # (p.grad read once: ~0.5 us)
        for p, _ in arrived:
            p.grad = None
        if self.data is None and arrived:
            if self._stash is None:
                self._stash = arrived
                return
            self._allocate()
            earlier, self._stash = self._stash, None
            self._add(earlier)
        self._add(arrived)

    @staticmethod
    def _add(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """main_grad += grad over (param, grad) pairs, one param at most once, in one foreach call."""
        pairs = [(p.main_grad, g) for p, g in pairs if not is_placeholder(g)]
        if pairs:
            torch._foreach_add_([m for m, _ in pairs], [g for _, g in pairs])

    def _launch(self, bucket: Bucket) -> None:
        bucket.launched = True
        if self.dp == 1:
            return
        if self.reduce_scatter:
            shard = bucket.shard(bucket.grad, self.dp_rank, self.dp)
            bucket.grad_work = reduce_scatter_flat(shard, bucket.grad, self.group, async_op=True)
        else:
            bucket.grad_work = dist.all_reduce(bucket.grad, group=self.group, async_op=True)

    def finish(self) -> None:
        """Launch the buckets not launched yet (in bucket order: the same on every rank) and wait for all."""
        if not self.per_param:
            self._fold()  # (normally a no-op: each backward folded its gradients when it ended)
        for bucket in self.buckets:
            if not bucket.launched:
                self._launch(bucket)
        self._wait_grads()

    def _wait_grads(self) -> None:
        for bucket in self.buckets:
            if bucket.grad_work is not None:
                bucket.grad_work.wait()
                bucket.grad_work = None

    # ------------------------------------------------------------- params (distributed optimizer)
    def start_param_gather(self, async_op: bool) -> None:
        """All-gather every bucket's updated param shards, first layers' buckets first (the next
        forward needs them first); wait here unless `async_op`."""
        if self.dp == 1:
            return
        for bucket in reversed(self.buckets):
            shard = bucket.shard(bucket.param_data, self.dp_rank, self.dp)
            bucket.gather_work = all_gather_flat(bucket.param_data, shard, self.group, async_op=True)
        if not async_op:
            self.wait_param_gather()

    def wait_param_gather(self, buckets=None) -> None:
        for bucket in self.buckets if buckets is None else buckets:
            if bucket.gather_work is not None:
                bucket.gather_work.wait()
                bucket.gather_work = None
