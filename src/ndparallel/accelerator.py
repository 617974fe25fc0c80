"""The `Accelerator`: Hugging Face Accelerate's training API over one ND device mesh.

It only orchestrates: the mesh comes from `ndparallel.mesh`, models are parallelised by `ndparallel.parallel`,
data loaders sharded by `ndparallel.data`, the loss made right by `ndparallel.loss`, sequences sharded by
`ndparallel.parallel.sequence`, clipping done by `ndparallel.clip`, metrics gathered by `ndparallel.operations`;
what it prepared is kept in one `ndparallel.record.PreparedObjects`, which checkpoints read and write.

Differences from Accelerate, on purpose:
- the LR scheduler steps once per optimizer step (Accelerate steps it once per process), so a run on N
  processes follows the same schedule as one process on the global batch;
- `backward` weights each rank's loss by its share of the optimizer step's loss tokens (see `ndparallel.loss`),
  so unequal numbers of -100 labels over ranks and micro-steps give the single-process gradient;
- `reduce` and `gather` run over the ranks that hold distinct data (the ``loss`` and ``batch`` views), never
  counting tensor-parallel copies twice; `reduce_loss` gives the exact global token mean of a step.
"""

from __future__ import annotations

import contextlib
import enum
import gc
import os
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from . import checkpoint, clip, metrics, operations, parallel
from .config import (
    ACCUMULATION_ENV,
    MIXED_PRECISION,
    MIXED_PRECISION_ENV,
    SIZE_FIELDS,
    FullyShardedDataParallelPlugin,
    ParallelismConfig,
    compute_dtype,
    size_env_var,
)
from .data import PreparedDataLoader
from .loss import GradientState
from .mesh import ParallelMesh
from .optim import AcceleratedOptimizer, AcceleratedScheduler
from .parallel.sequence import SequenceSharding
from .record import PreparedObjects
from .runtime import init_runtime
from .utils import progress_bar


class DistributedType(str, enum.Enum):
    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    FSDP = "FSDP"


def _axis_property(axis: str, what: str) -> property:
    def get(self: Accelerator) -> int:
        return self.mesh.rank(axis) if what == "rank" else self.mesh.size(axis)

    get.__doc__ = f"This process's coordinate along ``{axis}``." if what == "rank" else f"Size of ``{axis}``."
    return property(get)


class Accelerator:
    """Trains a model with the parallelisms of a `ParallelismConfig` (plain DDP over all processes without one).

    Args:
        parallelism_config: sizes of each parallelism; sizes it leaves unset are read from what ``ndparallel launch``
            passed (`ParallelismConfig.from_env`). None: the launch's sizes, or DDP over every process when none
            were passed.
        fsdp_plugin: FSDP2 settings. FSDP2 wraps the model when parameters are sharded (``dp_shard * cp * sp > 1``),
            when a plugin is given, or when tensor parallelism meets data parallelism (torch's DDP takes no DTensor
            parameters, so replication is FSDP2 over a shard group of one).
        mixed_precision: "no", "bf16" or "fp16" (None: ``$NDPARALLEL_MIXED_PRECISION`` or "no").
        gradient_accumulation_steps: micro-steps per optimizer step (None: ``$NDPARALLEL_GRADIENT_ACCUMULATION_STEPS``
            or 1).
        cpu: train on the CPU with gloo even where CUDA is available.
        device_placement: move batches of prepared data loaders to this rank's device.
        project_dir / project_config: where `save_state` / `load_state` put and find checkpoints
            (`ProjectConfiguration`, Accelerate's names: automatic_checkpoint_naming, total_limit, iteration).
    """

    def __init__(self, parallelism_config: ParallelismConfig | None = None,
                 fsdp_plugin: FullyShardedDataParallelPlugin | None = None, mixed_precision: str | None = None,
                 gradient_accumulation_steps: int | None = None, cpu: bool = False,
                 device_placement: bool = True, project_dir: str | os.PathLike | None = None,
                 project_config: checkpoint.ProjectConfiguration | None = None) -> None:
        # Every check on user input comes before the first collective.
        if parallelism_config is not None and not isinstance(parallelism_config, ParallelismConfig):
            raise TypeError(f"parallelism_config must be a ParallelismConfig, got {type(parallelism_config).__name__}")
        if fsdp_plugin is not None and not isinstance(fsdp_plugin, FullyShardedDataParallelPlugin):
            raise TypeError(f"fsdp_plugin must be a FullyShardedDataParallelPlugin, got {type(fsdp_plugin).__name__}")
        if project_config is not None and not isinstance(project_config, checkpoint.ProjectConfiguration):
            raise TypeError(f"project_config must be a ProjectConfiguration, got {type(project_config).__name__}")
        self.project_configuration = project_config or checkpoint.ProjectConfiguration()
        if project_dir is not None:
            self.project_configuration.set_directories(project_dir)
        where = "mixed_precision"
        if mixed_precision is None:
            mixed_precision, where = os.environ.get(MIXED_PRECISION_ENV, "no"), f"${MIXED_PRECISION_ENV}"
        if mixed_precision not in MIXED_PRECISION:
            raise ValueError(f"{where} must be one of {list(MIXED_PRECISION)}, got {mixed_precision!r}")
        where = "gradient_accumulation_steps"
        if gradient_accumulation_steps is None:
            raw, where = os.environ.get(ACCUMULATION_ENV, "1"), f"${ACCUMULATION_ENV}"
            try:
                gradient_accumulation_steps = int(raw)
            except ValueError:
                raise ValueError(f"{where} must be an int >= 1, got {raw!r}") from None
        if isinstance(gradient_accumulation_steps, bool) or not isinstance(gradient_accumulation_steps, int):
            raise TypeError(f"{where} must be an int >= 1, got {gradient_accumulation_steps!r}")
        if gradient_accumulation_steps < 1:
            raise ValueError(f"{where} must be an int >= 1, got {gradient_accumulation_steps!r}")
        if parallelism_config is None:
            launched = any(os.environ.get(size_env_var(f)) for f in SIZE_FIELDS)
            parallelism_config = ParallelismConfig() if launched else ParallelismConfig(dp_replicate_size=-1)
        parallelism_config = ParallelismConfig.from_env(parallelism_config)

        self.runtime = init_runtime(cpu)
        self.parallelism_config = parallelism_config.resolve(self.runtime.world_size)
        self.mesh = ParallelMesh(self.parallelism_config, self.device.type,
                                 fsdp=parallel.uses_fsdp(self.parallelism_config, fsdp_plugin))
        self.fsdp_plugin = fsdp_plugin
        self.mixed_precision = mixed_precision
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.device_placement = device_placement
        self.gradient_state = GradientState(gradient_accumulation_steps, self.mesh.size("loss"))
        # This rank's part of every sequence under context/sequence parallelism (None without): the one geometry
        # the data loaders count loss tokens with and maybe_context_parallel shards with.
        self.sequence_sharding = SequenceSharding.from_mesh(self.mesh)
        scaler = torch.amp.GradScaler(self.device.type) if mixed_precision == "fp16" else None
        self.prepared = PreparedObjects(self.gradient_state, scaler)  # what save_state / load_state cover
        # id(original parameter) -> (weak reference to it, the parameter that replaced it in prepare()).
        self._param_map: dict[int, tuple[weakref.ref, nn.Parameter]] = {}
        self._taken: set[int] = set()  # ids of every object prepare() has taken, to refuse a second time
        checkpoint.announce(fsdp_plugin)  # cpu_ram_efficient_loading: tell transformers, as Accelerate does

    # ---- processes and mesh ------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.runtime.device

    @property
    def process_index(self) -> int:
        return self.runtime.rank

    @property
    def local_process_index(self) -> int:
        return self.runtime.local_rank

    @property
    def num_processes(self) -> int:
        return self.runtime.world_size

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The gradient scaler of fp16 mixed precision (None otherwise)."""
        return self.prepared.scaler

    @property
    def torch_device_mesh(self):
        """The world `DeviceMesh`: a dimension for each axis of more than one rank, and the flattened views that
        span several of them, by name (``mesh[name]`` answers every view name)."""
        return self.mesh.world

    @property
    def distributed_type(self) -> DistributedType:
        if parallel.uses_fsdp(self.parallelism_config, self.fsdp_plugin):
            return DistributedType.FSDP
        if self.num_processes == 1:
            return DistributedType.NO
        return DistributedType.MULTI_GPU if self.device.type == "cuda" else DistributedType.MULTI_CPU

    dp_replicate_rank, dp_replicate_size = _axis_property("dp_replicate", "rank"), _axis_property("dp_replicate", "size")
    dp_shard_rank, dp_shard_size = _axis_property("dp_shard", "rank"), _axis_property("dp_shard", "size")
    cp_rank, cp_size = _axis_property("cp", "rank"), _axis_property("cp", "size")
    sp_rank, sp_size = _axis_property("sp", "rank"), _axis_property("sp", "size")
    tp_rank, tp_size = _axis_property("tp", "rank"), _axis_property("tp", "size")
    data_parallel_rank = _axis_property("batch", "rank")
    data_parallel_size = _axis_property("batch", "size")

    @property
    def sync_gradients(self) -> bool:
        """True on the micro-step whose backward synchronises gradients and after which the optimizer steps."""
        return self.gradient_state.sync_gradients

    # ---- prepare -------------------------------------------------------------------------------------
    def prepare(self, *args: Any, tp_plan: dict[str, str] | None = None) -> Any:
        """Prepare models, optimizers, data loaders and LR schedulers, in any order and number.

        Returns them in the order given (a single object when one was given). Models are prepared first, so an
        optimizer built from a model's parameters before `prepare` is pointed at the parameters that replace them.
        `tp_plan` (pattern -> style, see `ndparallel.parallel.tensor`) overrides the tensor-parallel plan of the
        models passed.
        """
        kinds = [self._kind(i, obj) for i, obj in enumerate(args)]
        seen: set[int] = set()
        for i, obj in enumerate(args):
            if id(obj) in self._taken or id(obj) in seen or isinstance(
                    obj, (DistributedDataParallel, FSDPModule, AcceleratedOptimizer, PreparedDataLoader,
                          AcceleratedScheduler)):
                raise ValueError(
                    f"prepare(): argument {i} (a {type(obj).__name__}) is already prepared; pass each plain "
                    "object to prepare() once"
                )
            seen.add(id(obj))
        out = list(args)
        for kind in ("model", "optimizer", "dataloader", "scheduler"):
            for i, obj in enumerate(args):
                if kinds[i] == kind:
                    extra = {"tp_plan": tp_plan} if kind == "model" else {}
                    out[i] = getattr(self, f"prepare_{kind}")(obj, **extra)
                    self._taken.add(id(obj))  # only once prepared: a failed prepare() may be retried
        return out[0] if len(out) == 1 else tuple(out)

    @staticmethod
    def _kind(index: int, obj: Any) -> str:
        if isinstance(obj, nn.Module):
            return "model"
        if isinstance(obj, torch.optim.Optimizer):
            return "optimizer"
        if isinstance(obj, (DataLoader, PreparedDataLoader)):
            return "dataloader"
        if isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, AcceleratedScheduler)):
            return "scheduler"
        raise TypeError(
            f"prepare(): argument {index} is a {type(obj).__module__}.{type(obj).__name__}; prepare() takes "
            "torch.nn.Module, torch.optim.Optimizer, torch.utils.data.DataLoader and "
            "torch.optim.lr_scheduler.LRScheduler objects"
        )

    def prepare_model(self, model: nn.Module, tp_plan: dict[str, str] | None = None) -> nn.Module:
        old = dict(model.named_parameters())
        options = parallel.PrepareOptions(self.device, self.fsdp_plugin, self.mixed_precision, tp_plan)
        # A model on the meta device (cpu_ram_efficient_loading) gets its weights after it is parallelised.
        prepared = checkpoint.parallelize_loading_weights(
            model, self.fsdp_plugin, self.device, lambda m: parallel.parallelize(m, self.mesh, options))
        new = dict(self.unwrap_model(prepared).named_parameters())
        for name, param in old.items():
            if new.get(name) is not None and new[name] is not param:
                self._param_map[id(param)] = (weakref.ref(param), new[name])
        self.prepared.models.append(prepared)
        for opt in self.prepared.optimizers:  # optimizers prepared before this model follow its new parameters too
            self._remap(opt.optimizer)
        return prepared

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> AcceleratedOptimizer:
        self._remap(optimizer)
        wrapped = AcceleratedOptimizer(optimizer, self.gradient_state, self.scaler)
        self.prepared.optimizers.append(wrapped)
        return wrapped

    def _remap(self, optimizer: torch.optim.Optimizer) -> None:
        """Point `optimizer` at the parameters that replaced the ones it was built with."""
        remapped = False
        for group in optimizer.param_groups:
            params = []
            for p in group["params"]:
                entry = self._param_map.get(id(p))
                if entry is not None and entry[0]() is p:
                    p, remapped = entry[1], True
                params.append(p)
            group["params"] = params
        if remapped and optimizer.state:
            raise ValueError(
                "prepare(): the optimizer already has state (it stepped before prepare), and its parameters were "
                "replaced by sharded ones; build the optimizer, prepare it, then train"
            )

    def prepare_dataloader(self, dataloader: DataLoader) -> PreparedDataLoader:
        # One shuffling seed for every rank, rank 0's: its sampler's or data loader's generator seed if either
        # has one, else its torch seed -- so ranks seeded differently (or not at all) still draw one order.
        generator = getattr(getattr(dataloader.batch_sampler, "sampler", None), "generator", None) \
            or dataloader.generator
        seed = torch.tensor([(generator.initial_seed() if generator is not None else torch.initial_seed()) % 2**62],
                            dtype=torch.long, device=self.device)
        if self.num_processes > 1:
            dist.broadcast(seed, src=0)
        sharding = self.sequence_sharding  # under CP/SP a rank's loss averages over its shard's tokens only
        prepared = PreparedDataLoader(
            dataloader, num_shards=self.mesh.size("batch"), shard_index=self.mesh.rank("batch"),
            seed=int(seed.item()), device=self.device, put_on_device=self.device_placement,
            window=self.gradient_accumulation_steps,
            window_group=self.mesh.group("batch") if self.mesh.size("batch") > 1 else None,
            gradient_state=self.gradient_state,
            local_count=sharding.count_loss_tokens if sharding is not None else None,
        )
        self.prepared.dataloaders.append(prepared)
        return prepared

    prepare_data_loader = prepare_dataloader  # Accelerate's spelling

    def prepare_scheduler(self, scheduler: torch.optim.lr_scheduler.LRScheduler) -> AcceleratedScheduler:
        optimizers = [o for o in self.prepared.optimizers if scheduler.optimizer in (o, o.optimizer)]
        if not optimizers:
            raise ValueError(
                "prepare(): the LR scheduler's optimizer has not been prepared; pass the optimizer to prepare() "
                "in the same call or before the scheduler"
            )
        wrapped = AcceleratedScheduler(scheduler, optimizers, self.gradient_state)
        self.prepared.schedulers.append(wrapped)
        return wrapped

    # ---- the training step --------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, with the loss weighted so gradients equal the single-process ones.

        `loss` must be this rank's mean loss over its own tokens (what HF models return); see `ndparallel.loss`
        for the factor and why.
        """
        loss = loss * self.gradient_state.loss_factor()
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        with self.loss_parallel():
            loss.backward(**kwargs)

    def loss_parallel(self) -> contextlib.AbstractContextManager:
        """torch's `loss_parallel` context when ``TorchTensorParallelConfig(loss_parallel=True)`` and tp > 1 (else
        nothing): cross-entropy on logits split over the vocabulary. Prepared models enter it for their own
        forward and `backward` for the backward; wrap a loss you compute yourself from ``outputs.logits`` in it."""
        if self.mesh.size("tp") > 1 and self.parallelism_config.tp_handler.loss_parallel:
            return loss_parallel()
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def accumulate(self, *models: nn.Module) -> Iterator[None]:
        """One micro-step: gradients synchronise (and the optimizer steps) only on the last of a window."""
        sync = self.gradient_state.advance()
        with contextlib.ExitStack() as stack:
            if not sync:
                for model in models or self.prepared.models:
                    stack.enter_context(self.no_sync(model))
            yield

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Skip the gradient reduction of backward passes inside (gradients accumulate locally)."""
        if isinstance(model, DistributedDataParallel):
            with model.no_sync():
                yield
        elif isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)
        else:
            yield

    @contextlib.contextmanager
    def maybe_context_parallel(self, buffers: list[torch.Tensor] | None = None,
                               buffer_seq_dims: list[int] | None = None,
                               no_restore_buffers: set[torch.Tensor] | None = None) -> Iterator[None]:
        """Shard `buffers` in place along `buffer_seq_dims` over ``cp x sp`` for the block; a no-op without CP/SP.

        Inside, each buffer holds this rank's part of every sequence (load-balanced: chunks r and 2*cp-1-r of
        2*cp; with sp > 1, a contiguous 1/sp of that; see `ndparallel.parallel.sequence.SequenceShards`) and the
        prepared model's attention spans the whole sequence. On exit, buffers not in `no_restore_buffers` get their
        full contents back. Pass ``shift_labels`` (labels shifted by one *before* sharding) rather than ``labels``,
        and ``position_ids``; run backward inside too. Nothing here communicates: bad input raises on every rank
        before any collective.
        """
        if buffers is not None and buffer_seq_dims is not None and len(buffers) != len(buffer_seq_dims):
            raise ValueError(f"maybe_context_parallel: {len(buffers)} buffers but {len(buffer_seq_dims)} buffer_seq_dims")
        if self.sequence_sharding is None:
            yield
            return
        batch = self.gradient_state.batch
        with self.sequence_sharding.sharded(buffers, buffer_seq_dims, no_restore_buffers,
                                            expected_tokens=batch.local_tokens if batch is not None else None):
            yield

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        dtype = compute_dtype(self.mixed_precision)
        with torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None):
            yield

    def unscale_gradients(self) -> None:
        if self.scaler is None:
            return
        for opt in self.prepared.optimizers:
            try:
                self.scaler.unscale_(opt.optimizer)
            except RuntimeError as exc:  # already unscaled since the last update(): nothing to do
                if "already been called" not in str(exc):
                    raise

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the total gradient norm, computed correctly over sharded (DTensor) and plain gradients."""
        self.unscale_gradients()
        return clip.clip_grad_norm_(parameters, max_norm, norm_type)

    # ---- collectives for metrics ----------------------------------------------------------------------
    def gather(self, tensor: Any) -> Any:
        """Concatenate tensors (or dicts/lists of them) along dim 0 over the ranks with distinct samples."""
        return operations.gather(tensor, self.mesh, "batch")

    def gather_for_metrics(self, data: Any, use_gather_object: bool = False) -> Any:
        """`gather`, minus the samples repeated to even out the last batch across ranks."""
        drop = self.gradient_state.remainder
        if use_gather_object or not isinstance(data, (torch.Tensor, dict, list, tuple)):
            parts = operations.gather_object(data, self.mesh, "batch")
            flat = [x for part in parts for x in (part if isinstance(part, list) else [part])]
            return flat[: len(flat) - drop]
        gathered = self.gather(data)
        return operations.map_tensors(gathered, lambda t: t[: t.shape[0] - drop]) if drop else gathered

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Sum or average over the ranks whose values are distinct contributions (the ``loss`` view)."""
        return operations.reduce(tensor, self.mesh, "loss", reduction, scale)

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The global token mean of the loss of this optimizer step, for logging. Collective.

        Call it once per micro-step with that micro-step's `loss` (this rank's mean, as passed to `backward`). It
        returns the mean over every loss token of every rank of the ``loss`` view and of the micro-steps of the
        current accumulation window so far -- on the micro-step that ends the window (``sync_gradients``), exactly
        the loss a single process computes on the whole global batch of the step, whatever the -100 labels, context
        / sequence shards and accumulation steps. Without loss-token counts (no labels in the batch) it is the mean
        of the ranks' and micro-steps' losses. A float64 scalar tensor, so that summing many ranks' fp32 losses adds no
        rounding of its own. See `ndparallel.loss`.
        """
        sums = operations.reduce(self.gradient_state.log_loss(loss), self.mesh, "loss", "sum")
        return sums[0] / sums[1]

    # ---- checkpoints (ndparallel.checkpoint; docs/checkpoints.md) ---------------------------------------------
    @property
    def project_dir(self) -> str | os.PathLike | None:
        return self.project_configuration.project_dir

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and restore `objects` (anything with ``state_dict`` / ``load_state_dict``) with the state."""
        bad = [i for i, o in enumerate(objects) if not (hasattr(o, "state_dict") and hasattr(o, "load_state_dict"))]
        if bad:
            raise ValueError(f"register_for_checkpointing: object(s) at position(s) {bad} have no state_dict and "
                             "load_state_dict methods")
        self.prepared.custom_objects.extend(objects)

    def save_state(self, output_dir: str | os.PathLike | None = None, **kwargs: Any) -> str:
        """Write a crash-safe, sharded checkpoint of everything prepared (and registered); return its directory.

        Without `output_dir`, ``ProjectConfiguration(automatic_checkpoint_naming=True)`` names it
        ``<project_dir>/checkpoints/checkpoint_<i>`` and keeps the newest ``total_limit``. Collective.
        """
        self._ignored_kwargs("save_state", kwargs)
        return str(checkpoint.save_state(self.prepared, self._run_settings(), self.project_configuration, output_dir))

    def load_state(self, input_dir: str | os.PathLike | None = None, **kwargs: Any) -> str:
        """Restore a checkpoint written by `save_state` under this or any other layout (the newest complete one
        of the project without `input_dir`); return its directory. Collective."""
        self._ignored_kwargs("load_state", kwargs)
        return str(checkpoint.load_state(self.prepared, self.project_configuration, input_dir))

    def _run_settings(self) -> checkpoint.RunSettings:
        plugin = self.fsdp_plugin
        return checkpoint.RunSettings(self.parallelism_config, self.device.type, self.mixed_precision,
                                      self.gradient_accumulation_steps,
                                      plugin.state_dict_type if plugin is not None else checkpoint.SHARDED)

    def save_model(self, model: nn.Module, save_directory: str | os.PathLike, max_shard_size: int | str = "10GB",
                   safe_serialization: bool = True) -> str:
        """Write `model`'s full weights from any layout as a Hugging Face directory. Collective."""
        return str(checkpoint.save_model(model, self.unwrap_model(model), save_directory, max_shard_size,
                                         safe_serialization))

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The full state dict on the main process (an empty dict elsewhere when parameters are sharded)."""
        return checkpoint.get_state_dict(model, unwrap)

    @staticmethod
    def _ignored_kwargs(method: str, kwargs: dict[str, Any]) -> None:
        if kwargs:  # Accelerate's safe_serialization, load_kwargs...: ndparallel's format has no such choices
            warnings.warn(f"{method}: ignoring {sorted(kwargs)}", stacklevel=3)

    # ---- process control -------------------------------------------------------------------------------
    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.is_main_process:
            print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        if self.num_processes > 1:
            dist.barrier()

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        if not self.is_main_process:
            self.wait_for_everyone()
        yield
        if self.is_main_process:
            self.wait_for_everyone()

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        if not self.is_local_main_process:
            self.wait_for_everyone()
        yield
        if self.is_local_main_process:
            self.wait_for_everyone()

    def progress_bar(self, iterable: Any = None, **kwargs: Any):
        """A tqdm bar drawn by the main process only."""
        return progress_bar(iterable, main_process=self.is_main_process, **kwargs)

    def step_timer(self, model: nn.Module | None = None, seq_len: int | None = None,
                   peak_flops: float | None = None) -> metrics.StepTimer:
        """A `ndparallel.metrics.StepTimer` for this job: step time, tokens/s and MFU over all processes (FLOPs per
        token from ``model.config`` at `seq_len`; peak FLOP/s given, from a table, or estimated on CPU)."""
        return metrics.timer_for(self, model, seq_len, peak_flops)

    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True) -> nn.Module:
        """The model without its DDP wrapper (FSDP2 and checkpointing change no parameter names)."""
        return parallel.unwrap(model)

    def end_training(self) -> None:
        """Release the process group (call once, at the end of the script)."""
        if dist.is_initialized():
            self.wait_for_everyone()
            # Free dead gloo work objects while the interpreter is whole: left to interpreter shutdown, they
            # abort the process now and then ("terminate called without an active exception", 4 of 33 runs).
            gc.collect()
            dist.destroy_process_group()

    def __repr__(self) -> str:
        return (f"Accelerator({self.mesh!r}, rank={self.process_index}/{self.num_processes}, "
                f"device={self.device}, mixed_precision={self.mixed_precision!r})")
