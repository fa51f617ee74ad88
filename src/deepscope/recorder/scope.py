"""`Scope`: the training-side entry point. One scope writes one run (one file per rank)."""

from __future__ import annotations

import atexit
import logging
import shutil
import sys
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..anomalies.monitor import HealthMonitor
from ..distributed import DEFAULT_TIMEOUT_S, CollectiveError, Reducer
from ..errors import DeepscopeWarning
from ..hookstate import hooks_paused
from ..layouts import sequence_first_modules
from ..naming import ModelNames
from ..records import InstrumentWarning
from ..store import limits
from ..store.layout import check_run_name, rank_file, rank_files
from ..store.writer import FINISHED, INTERRUPTED, RunLock, StoreWriter
from .buffers import BufferPool
from .context import StepContext, StepOutcome
from .passes import ScaleCheck
from .ranks import agree_run_id, any_rank, first_failure, run_meta, unwrap, world_size
from .schedule import Schedule, as_schedule, every
from .stats import DEFAULT_MAX_NEURONS
from .step import StepRecorder, check_text

log = logging.getLogger("deepscope")
_open_scopes: weakref.WeakSet = weakref.WeakSet()
MAX_STEP = 2**63 - 1  # SQLite's largest integer
KPI_FLUSH_SECONDS = 1.0  # unrecorded steps' KPIs are committed at least this often
CHECK_GRADS_EVERY = 10  # the default health check reads gradients on every 10th step


class Scope:
    """Records one training run into `path/run/`.

    path: project folder (created if missing). run: run name (a folder inside it).
    schedule: which steps record tensors — `every(n)`, `at([...])`, `log_spaced()`,
        `per_kind(n)`, an int n, or any callable (step, kind) -> bool. Default every(10).
    instruments: None, "economy", "business", "full" or a list of quantity names (computed
        for the model given to `watch`), on `instrument_schedule` (default: `schedule`).
    instrument_options: more settings of `deepscope.instruments.Instruments`, e.g.
        {"curvature": "hutchinson", "hist_bins": 50, "lanczos_iter": 20}.
    max_samples: batch items whose full values are stored per tensor record.
    dynamic / keep_if: steps chosen by `dynamic` but not by `schedule` are recorded
        tentatively and kept if `keep_if(rec)` is true or `rec.keep()` was called.
    overwrite / resume: what to do if the run exists (default: refuse with an error).
        Each run and rank has one writer (an OS lock, released when its process ends); a
        second one is refused. resume continues after the last committed step.
    rank: this process's rank file (default: the torch.distributed rank, else 0).
    distributed: "auto" (default): on when a torch.distributed process group of world size
        > 1 is initialised; True: required (an error without one); False: each rank records
        alone, its instrument values those of its own micro-batch. On, instrument values mean
        the global batch (rank 0's file holds them), every rank's file holds its local
        values and the same run id, and the ranks agree on what must not differ (see
        docs/distributed.md, "Recording"). Creating the Scope is then collective: every
        rank creates its Scope at the same point of the program, with the same arguments.
        `scope.reducer` holds deepscope's collectives (None when off).
    distributed_timeout_s: how long one of deepscope's collectives waits for the other ranks
        (seconds); past it, distributed instruments are off for the rest of the run (one
        warning line, the values missing with the reason) and training goes on.
    on_full: "block" (back-pressure) or "drop" (drop whole steps) when the writer lags.
    exact_views: store per-neuron / per-sample aggregate views as float32 instead of
        bfloat16 (twice the bytes). Statistics and sample values are always exact.
    anomalies: the health check of the watched model. "check" (default): a non-finite loss
        on every step, gradients every 10th step (with a loss on the CPU; else, and in a
        distributed run, every step: see docs/distributed.md),
        the first non-finite gradient named — also when it was on an unchecked step whose
        update made the next loss non-finite (`scope.monitor.grad_every = 1` checks every
        step) — plus the detectors: the loss spike on every step, the gradient norms every
        10 steps, the activations and update ratios every 50 (see
        `deepscope.anomalies.detectors`); "trace":
        also hooks every module to name the *first* tensor, forward or backward, where a
        non-finite value appears (costs more: ~20% on a small MLP); False/None: off. After
        a non-finite step the next `record_next` steps are recorded in full.
        `on_anomaly(finding)` is called for every finding; raise
        `deepscope.anomalies.StopTraining` from it to stop training.
    """

    def __init__(self, path: str | Path = "runs", run: str = "run", *,
                 schedule: Schedule | int | None = None,
                 instruments: str | Sequence[str] | None = None,
                 max_samples: int = 4,
                 dynamic: Schedule | int | None = None,
                 keep_if: Callable[[StepRecorder], bool] | None = None,
                 instrument_schedule: Schedule | int | None = None,
                 quantity_schedules: dict[str, Schedule] | None = None,
                 instrument_options: dict[str, Any] | None = None,
                 overwrite: bool = False, resume: bool = False,
                 rank: int | None = None, queue_size: int = 32, on_full: str = "block",
                 singular_values: bool = False, max_neurons: int = DEFAULT_MAX_NEURONS,
                 exact_views: bool = False, anomalies: str | bool | None = "check",
                 on_anomaly: Callable[[Any], None] | None = None, record_next: int = 3,
                 seed: int = 0, distributed: bool | str = "auto",
                 distributed_timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        check_run_name(run)
        if overwrite and resume:
            raise ValueError("pass either overwrite=True or resume=True, not both")
        for arg, value, low in (("max_samples", max_samples, 0), ("max_neurons", max_neurons, 0),
                                ("queue_size", queue_size, 1), ("record_next", record_next, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{arg} must be an integer >= {low}, got {value!r}")
        if max_samples > limits.MAX_SAMPLES:
            # Readers refuse more (a crafted file's guard): never write a run nobody can read.
            raise ValueError(f"max_samples must be at most {limits.MAX_SAMPLES}, got "
                             f"{max_samples}; store fewer batch items")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)
                                 or rank < 0):
            raise ValueError(f"rank must be an integer >= 0 (or None: the torch.distributed "
                             f"rank), got {rank!r}")
        if distributed not in ("auto", True, False):
            raise ValueError(f"distributed must be 'auto', True or False, got {distributed!r}")
        if (isinstance(distributed_timeout_s, bool)
                or not isinstance(distributed_timeout_s, (int, float))
                or not 0 < distributed_timeout_s < float("inf")):
            raise ValueError(f"distributed_timeout_s must be a number of seconds > 0, got "
                             f"{distributed_timeout_s!r}")
        self.schedule = every(10) if schedule is None else as_schedule(schedule)
        self.dynamic = as_schedule(dynamic, "dynamic") if dynamic is not None else None
        self.keep_if = keep_if
        self.max_samples = max_samples
        self.max_neurons = max_neurons
        self.singular_values = singular_values
        self.exact_views = exact_views
        self.run_dir = Path(path) / run
        if instruments is not None:  # a typo fails here, not at watch()
            from ..catalogue import resolve_quantities
            resolve_quantities(instruments)
        self._instrument_spec = instruments
        self._instrument_schedule = (self.schedule if instrument_schedule is None
                                     else as_schedule(instrument_schedule))
        self._quantity_schedules = quantity_schedules
        self._instrument_options = dict(instrument_options or {})
        self._seed = seed
        self.instruments: Any = None
        self.monitor: Any = None
        self._optimizer: torch.optim.Optimizer | None = None  # its lr is logged as a KPI
        self._step_lr: float | torch.Tensor | None = None  # that lr at the current step's start
        if anomalies not in (None, False, True, "check", "trace"):
            raise ValueError(f"anomalies must be 'check', 'trace' or False, not {anomalies!r}")
        self._anomalies = "check" if anomalies is True else (anomalies or None)
        self._on_anomaly = on_anomaly
        self._record_next = record_next
        self._force_record = 0
        self._kpi_rows: list[tuple[str, int, str, Any]] = []
        self._kpi_sent = time.monotonic()
        self._params: dict[str, torch.Tensor] = {}
        self._scaler: Any = None  # a GradScaler given to watch()
        self._scale_check = ScaleCheck(self._warn_once)
        self._param_nodes: dict[str, tuple[str, str]] = {}
        self._module_hooks: dict[int, list[Any]] = {}  # id(model) -> its activation hooks
        # the models watched (model, names, node_depth): their parameters are looked up again
        # at each recorded step, so a replaced module (model.head = ...) is not recorded stale
        self._watched: list[tuple[nn.Module, ModelNames, int | None]] = []
        self._watched_params: list[torch.Tensor] = []  # theirs at the last look
        self._step_hooks: dict[int, Any] = {}  # optimizer id -> its step post hook
        self._stance: Any = None  # the force_eager stance of the open step, to restore
        self._graph_cache: dict = {}
        self._infos: dict = {}  # TensorInfo by description, across steps (StepContext.infos)
        self.buffers = BufferPool()
        self._current: StepRecorder | None = None
        self._context: tuple[tuple, StepContext] | None = None  # see _step_context
        self._last_step: int | None = None
        self._checked_kind: str | None = None  # the step kind checked last
        self._reported: set[str] = set()
        self._agree_keep = False  # this step's dynamic decision is agreed across ranks
        self._world = world_size()
        # Collective (a process group of deepscope's own): after every check above, which
        # fails alike on every rank, so that no rank waits for one that raised.
        try:
            self.reducer = Reducer.create(distributed, distributed_timeout_s)
        except RuntimeError as exc:  # torch's DistStoreError: the other ranks never came
            raise ValueError(
                f"the other ranks did not create their Scope within distributed_timeout_s="
                f"{distributed_timeout_s:g} s ({type(exc).__name__}); create a Scope on every "
                "rank at the same point, or pass distributed=False to record on some ranks "
                "only") from None
        if self.reducer is not None and rank is not None and rank != self.reducer.rank:
            raise ValueError(f"rank={rank} differs from this process's torch.distributed rank "
                             f"{self.reducer.rank}; leave rank unset in a distributed run")
        self.rank = _default_rank() if rank is None else rank
        self.closed = False
        self.writer = self._open_writer(run, overwrite, resume, queue_size, on_full)
        if resume:
            self._last_step = self.writer.last_step()
        _open_scopes.add(self)

    def _open_writer(self, run: str, overwrite: bool, resume: bool, queue_size: int,
                     on_full: str) -> StoreWriter:
        """This rank's writer; in a distributed run every rank checks the run folder before
        any rank writes in it, and they agree on the outcome and on rank 0's run id."""
        reducer = self.reducer
        if reducer is None:
            return self._create_writer(run, overwrite, resume, queue_size, on_full)
        existing = rank_files(self.run_dir)
        try:
            # rank 0 alone probes the locks (it removes the folder): ranks probing the same
            # lock files at once would each see the other's probe as a writer
            self._check_existing(run, existing, overwrite, resume,
                                 probed=existing if self.rank == 0 else {})
            error = None
        except ValueError as exc:
            error = exc
        self._raise_if_any_failed(error, "refused the run folder")
        if overwrite and existing:
            if self.rank == 0:
                shutil.rmtree(self.run_dir, ignore_errors=True)
            reducer.agree(True)  # the folder is gone before any rank creates its file
            if self.rank != 0 and rank_file(self.run_dir, self.rank).exists():
                shutil.rmtree(self.run_dir)  # not a shared folder: this rank's own copy
        writer, error = None, None
        try:
            writer = self._create_writer(run, overwrite, resume, queue_size, on_full)
        except ValueError as exc:
            error = exc
        try:
            self._raise_if_any_failed(error, "could not open its rank file")
            run_id = agree_run_id(reducer, writer.run_id)
        except BaseException:
            if writer is not None:
                writer.close(INTERRUPTED)
            raise
        writer.submit_meta({"distributed": run_meta(reducer, run_id)})
        return writer

    def _raise_if_any_failed(self, error: ValueError | None, what: str) -> None:
        """Raise `error` here, or a one-line error if another rank failed (collective)."""
        failed = first_failure(self.reducer, error)
        if error is not None:
            raise error
        if failed is not None:
            raise ValueError(f"rank {failed} {what} (its error says why); every rank stops "
                             "creating this Scope")

    def _check_existing(self, run: str, existing: dict, overwrite: bool, resume: bool,
                        probed: dict) -> None:
        """Refuse this rank's existing file (unless overwrite / resume), and overwrite while
        a writer holds one of the `probed` files."""
        # another rank's file is the same run, written by that rank: only this rank's refuses
        if self.rank in existing and not (overwrite or resume):
            raise ValueError(f"run {run!r} already exists in {self.run_dir.parent}; pass "
                             "overwrite=True to replace it, resume=True to continue it, or "
                             "choose another run name")
        if overwrite and probed:
            busy = [p.name for p in probed.values() if RunLock.is_held(p)]
            if busy:
                raise ValueError(f"run {run!r} is being written by another process ({busy[0]}); "
                                 "wait for it to finish before overwrite=True, or choose "
                                 "another run name")

    def _create_writer(self, run: str, overwrite: bool, resume: bool, queue_size: int,
                       on_full: str) -> StoreWriter:
        target = rank_file(self.run_dir, self.rank)
        if self.reducer is None:  # (distributed: _open_writer did this for all ranks)
            existing = rank_files(self.run_dir)
            others = set(existing) - {self.rank}
            # with other ranks' files only this rank's is replaced: only its lock matters
            probed = {r: p for r, p in existing.items() if r == self.rank or not others}
            self._check_existing(run, existing, overwrite, resume, probed)
            if overwrite and others:
                # other ranks' files (another Scope of this run): replace this rank's only
                for path in (target, *target.parent.glob(target.name + "-*"),
                             target.with_name(target.name + ".lock")):
                    path.unlink(missing_ok=True)
            elif overwrite and existing:
                shutil.rmtree(self.run_dir)
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"cannot create run folder {self.run_dir}: {exc.strerror}; pass a "
                             "writable path") from None
        meta = {"run": run, "rank": self.rank, "torch": torch.__version__,
                "schedule": repr(self.schedule), "instruments": self._instrument_spec,
                "max_samples": self.max_samples, "max_neurons": self.max_neurons,
                "exact_views": self.exact_views,
                "argv": sys.argv[:8], "started": time.time()}
        try:
            return StoreWriter(target, meta, resume=resume, queue_size=queue_size,
                               on_full=on_full)
        except ValueError:
            raise  # the writer's own one-line errors (on_full, schema version) name the fix
        except OSError as exc:
            raise ValueError(f"cannot write {target}: {exc}; pass a writable path") from None
        except Exception as exc:  # sqlite3 errors: unwritable, foreign or damaged file
            raise ValueError(f"cannot open {target} for writing ({exc}); pass a writable path "
                             "or a new run name") from None

    # --- set-up -------------------------------------------------------------------------
    def watch(self, model: nn.Module, *, name: str | None = None, activations: bool = False,
              optimizer: torch.optim.Optimizer | None = None,
              node_depth: int | None = None, scaler: Any = None) -> nn.Module:
        """Track every parameter of `model` (values and gradients) by dotted name.

        name: prefix for the names (default none): tensors, quantity layers, health findings
        and instrument warnings all carry the same names ("head.weight", module "head";
        without a name the root module is "model"). activations: also record every module's
        output by forward hooks (names from module paths; the model's own output has role
        "output"). optimizer: its learning rate (of the first parameter group, as at the start
        of each step) is logged as the KPI "learning_rate" unless the step logs one itself
        (the first watched model's optimiser); instruments read it too (CABS). Its `step()`
        ends its parameters' recorded gradients (a GAN's G loss reaching D after D's step is
        not D's), a closure it evaluates again inside `step()` (LBFGS) is not recorded, and
        a forward with gradients off after it (validation) is not recorded. node_depth:
        group parameters into graph nodes by the first `node_depth` parts of their module
        path (default: the full module path). scaler: the `torch.amp.GradScaler` whose
        `scale(loss).backward()` the steps run: recorded gradients are divided by the scale
        of their pass, as `unscale_` divides `.grad` (without it they carry the scale, and a
        warning says so). Returns the model unchanged.

        A `torch.compile`d model is watched through its original module (`_orig_mod`), so
        names are those of the eager model; a DistributedDataParallel model through its
        `.module` (the DDP wrapper, its buckets, `no_sync` and communication hooks are left
        as they are). Hooks do not fire inside compiled code, so every
        step that records, computes instruments or checks module outputs runs eagerly
        (`torch.compiler.set_stance("force_eager")`): its values are the eager model's; the
        other steps run compiled.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"scope.watch(...) needs a torch.nn.Module, got {type(model).__name__}")
        if scaler is not None:
            if not isinstance(scaler, torch.amp.GradScaler):
                raise TypeError(f"scope.watch(..., scaler=...) needs a torch.amp.GradScaler, got "
                                f"{type(scaler).__name__}")
            self._scaler = scaler
        compiled = model
        model = unwrap(model)  # torch.compile's and DDP's wrappers
        names = ModelNames.of(model, name)  # the one source of names for everything below
        watched = next((i for i, w in enumerate(self._watched) if w[0] is model),
                       len(self._watched))
        self._watched[watched:watched + 1] = [(model, names, node_depth)]
        self._params.update(_params_of(model, names))
        self._param_nodes.update(_param_nodes_of(model, names, node_depth))
        for h in self._module_hooks.pop(id(model), []):  # watched again: hooked once
            h.remove()
        if activations:
            sequence_first = sequence_first_modules(model)
            self._module_hooks[id(model)] = [
                module.register_forward_hook(self._activation_hook(
                    names.module(mpath), not mpath, id(module) in sequence_first))
                for mpath, module in model.named_modules()]
        if self._anomalies and self.monitor is None:
            self.monitor = HealthMonitor(model, names=names, record_next=self._record_next,
                                         trace=self._anomalies == "trace",
                                         grad_every=CHECK_GRADS_EVERY if self.reducer is None
                                         else 1, distributed=self.reducer is not None)
        if optimizer is not None and watched == 0:  # the first model's (its instruments')
            self._optimizer = optimizer
            # what the diagnosis needs to read ‖Δθ‖/‖g‖ (momentum, adaptive steps)
            self.writer.submit_meta({"optimizer": optimizer_settings(optimizer)})
            if self.instruments is not None:  # a new optimiser for it (CABS reads its rate)
                self.instruments.optimizer = optimizer
        if optimizer is not None:
            if id(optimizer) not in self._step_hooks:  # its step ends its parameters' gradients
                self._step_hooks[id(optimizer)] = (
                    optimizer.register_step_pre_hook(self._optimizer_stepping),
                    optimizer.register_step_post_hook(self._optimizer_stepped))
        if self.instruments is not None and model is not self.instruments.model:
            warnings.warn(f"deepscope: instruments cover the first watched model only "
                          f"({type(self.instruments.model).__name__}), not this "
                          f"{type(model).__name__}; use a Scope (its own run) per model to "
                          "instrument both", DeepscopeWarning, stacklevel=2)
        if self._instrument_spec is not None and self.instruments is None:
            from ..instruments.suite import Instruments  # loads only for a Scope with instruments
            # reducer: the global batch's values (rank-identical schedule, see step())
            across = {} if self.reducer is None else {"reducer": self.reducer}
            self.instruments = Instruments(
                model, self._instrument_spec, schedule=self._instrument_schedule,
                optimizer=optimizer, schedules=self._quantity_schedules, seed=self._seed,
                names=names, **across, **self._instrument_options)
        return compiled

    def note(self, text: str) -> None:
        """Store a free-text note (shown in the GUI's Notes tab) with the current step."""
        if not isinstance(text, str):
            raise TypeError(f"scope.note(...) needs a string, got {type(text).__name__}")
        check_text(text, "note")
        step = self._current.step if self._current is not None else self._last_step
        self.writer.submit_note(text, step)

    # --- steps ----------------------------------------------------------------------------
    def step(self, step: int, kind: str = "default") -> StepRecorder:
        """Open step `step` (0 <= step < 2**63, increasing) of kind `kind`; use as
        `with scope.step(n) as rec:`."""
        if self.closed:
            raise ValueError("this Scope is closed; create a new Scope (resume=True) to "
                             "record more")
        if self._current is not None:
            raise ValueError(f"scope.step({step}) called while step {self._current.step} is "
                             "still open; leave the previous `with` block first")
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an int, got {type(step).__name__}")
        if not 0 <= step <= MAX_STEP:
            raise ValueError(f"step must be between 0 and 2**63 - 1, got {step}; pass a global "
                             "step counter from 0")
        if kind is not self._checked_kind:  # (the same string on most steps)
            if not isinstance(kind, str) or not kind:
                raise TypeError(f"kind must be a non-empty string, got {kind!r}")
            check_text(kind, "kind")
            self._checked_kind = kind
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(f"step numbers must increase: got {step} after {self._last_step}; "
                             "pass a global step counter")
        live = self.writer.live()
        record = live and (bool(self.schedule(step, kind)) or self._force_record > 0)
        self._force_record = max(self._force_record - 1, 0)
        dynamic = self.dynamic is not None and bool(self.dynamic(step, kind))
        tentative = live and not record and dynamic
        # Distributed: whether to run the instruments (collectives) depends only on what is
        # the same on every rank (their schedules and state), never on this rank's writer or
        # findings; a dynamic step's keep is agreed at its end (see _keep).
        self._agree_keep = self.reducer is not None and dynamic
        instrumented = ((live or self.reducer is not None) and self.instruments is not None
                        and bool(self._guard(self.instruments.wants, step, kind)))
        return StepRecorder(self._step_context(), step, kind, record, tentative, instrumented)

    def begin_step(self, step: int, kind: str = "default") -> StepRecorder:
        """Open step `step` of kind `kind` for callers that cannot use a `with` block
        (framework callbacks); close it with `end_step`. The same as entering
        `scope.step(step, kind)`, with the same checks."""
        return self.step(step, kind).__enter__()

    def end_step(self, *, discard: bool = False) -> None:
        """Close the open step and store it. discard: store none of its data (its KPIs and
        instrument values included), as when a `with scope.step(n)` block is left by an
        exception: pass it for a step that failed or was left half-done.

        Raises:
            ValueError: if no step is open.
        """
        if self._current is None:
            raise ValueError("scope.end_step() called with no step open; open one with "
                             "scope.begin_step(n) first")
        self._end(self._current, discard)

    def _step_context(self) -> StepContext:
        """The context of the next step: the last one while none of the settings in it
        changed (building one costs ~10 µs after a step's kernels, on every step)."""
        key = (self.monitor, self.instruments, self.keep_if, self.max_samples,
               self.max_neurons, self.singular_values, self.exact_views, self._scaler)
        if self._context is None or self._context[0] != key:
            self._context = (key, StepContext(
                scope=self, begin=self._enter, end=self._end, guard=self._guard,
                warn_once=self._warn_once, params=self._params, param_nodes=self._param_nodes,
                graph_cache=self._graph_cache, infos=self._infos, buffers=self.buffers,
                monitor=self.monitor, instruments=self.instruments, keep_if=self.keep_if,
                max_samples=self.max_samples, max_neurons=self.max_neurons,
                singular_values=self.singular_values, exact_views=self.exact_views,
                scaler=self._scaler, scale_check=self._scale_check))
        return self._context[1]

    def _enter(self, rec: StepRecorder) -> None:
        self._current = rec
        self._last_step = rec.step
        self._step_lr = None
        if self._optimizer is not None:  # the rate this step's update uses
            try:
                lr = self._optimizer.param_groups[0]["lr"]
                # a tensor lr (capturable optimisers) is copied, not read: no host sync here
                self._step_lr = (lr.detach().clone() if isinstance(lr, torch.Tensor)
                                 and lr.numel() == 1 else float(lr))
            except (KeyError, IndexError, TypeError, ValueError):
                pass  # an optimiser without one plain learning rate: nothing to log
        if rec.recording and self._guard(self._refresh_params) is _FAILED:
            rec.recording = False
        if rec.recording and self._guard(rec._start) is _FAILED:
            rec.recording = False
        if rec._instrumented and self._guard(self.instruments.start, rec.step,
                                             rec.kind) is _FAILED:
            rec._instrumented = False
        if self.monitor is not None:
            self._guard(self.monitor.start, rec.step, rec.kind)
        # Hooks do not fire inside compiled code: a hooked step runs compiled models eagerly.
        # Without torch._dynamo imported nothing was compiled (and importing it costs ~1 s).
        if "torch._dynamo" in sys.modules and (rec.recording or rec._instrumented or (
                self.monitor is not None and self.monitor.hooks_modules)):
            self._stance = self._guard(torch.compiler.set_stance, "force_eager")
            if self._stance is _FAILED:  # e.g. called inside a compiled region
                self._stance = None

    def _refresh_params(self) -> None:
        """The watched models' parameters as they are now: a module replaced since `watch`
        (`model.head = nn.Linear(...)`) is recorded under its names, not the old one."""
        now = [p for model, _, _ in self._watched for p in model.parameters()]
        if len(now) == len(self._watched_params) and all(
                p is q for p, q in zip(now, self._watched_params)):
            return  # (the usual case, ~1 µs per parameter: no names made)
        self._watched_params = now
        params: dict[str, torch.Tensor] = {}
        for model, names, _ in self._watched:
            params.update(_params_of(model, names))
        self._param_nodes.clear()
        for model, names, node_depth in self._watched:
            self._param_nodes.update(_param_nodes_of(model, names, node_depth))
        self._params.clear()  # (in place: the step context holds this dict)
        self._params.update(params)

    def _optimizer_stepping(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any
                            ) -> None:
        rec = self._current
        if rec is not None:  # (on every step: rec.loss counts the closure's evaluations)
            rec._in_optimizer_step, rec._step_losses, rec._step_pass = True, 0, None

    def _optimizer_stepped(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any
                           ) -> None:
        rec = self._current
        if rec is not None:
            rec._in_optimizer_step = False
            if rec.recording:
                self._guard(rec._stepped, optimizer)

    def _end(self, rec: StepRecorder, failed: bool) -> None:
        self._current = None
        if self._stance is not None:
            self._stance.__exit__(None, None, None)  # the stance before this step
            self._stance = None
        self._store(rec._finish(failed))

    def _store(self, outcome: StepOutcome) -> None:
        """Route an ended step: KPIs, health findings, instrument values, recorded data."""
        if outcome.failed:  # the user's step raised: store nothing half-done
            if outcome.instrumented:
                self._guard(self.instruments.abort)
            return
        # The kind may have been decided during the step (dynamic recording).
        step, kind = outcome.step, outcome.kind
        rows = [(n, step, kind, v) for n, v in outcome.kpis]
        if self._step_lr is not None and not any(r[0] == "learning_rate" for r in rows):
            rows.append(("learning_rate", step, kind, self._step_lr))
        self._kpi_rows += rows
        findings = self._check_health(outcome.step)
        quantities = []
        if outcome.instrumented:
            quantities = self._guard(self.instruments.finish) or []
            if quantities is _FAILED:
                quantities = []
            self._guard(self._send_warnings, outcome.step)
        keep = self._keep(outcome)
        if self.reducer is not None:
            self._collectives_off(outcome.step)
            # the global batch's values go into rank 0's file; every rank keeps its own
            quantities = [q for q in quantities if q.local or self.rank == 0]
            if keep and not outcome.instrumented:
                quantities += self._guard(outcome.local) or []
        submitted = False
        if keep:
            payload = self._guard(outcome.payload)
            if payload is not _FAILED:
                payload.quantities = quantities
                # the KPIs so far ride in the step's own commit (not one of their own)
                payload.kpis, self._kpi_rows = self._kpi_rows, []
                if self.writer.submit_step(payload):
                    self._kpi_sent = time.monotonic()
                else:  # dropped (queue full): its KPIs are still stored
                    self._kpi_rows = payload.kpis
                submitted = True
        if not submitted:
            self.writer.submit_quantities(quantities)
        if self._kpi_rows and (outcome.recorded
                               or time.monotonic() - self._kpi_sent > KPI_FLUSH_SECONDS):
            self._send_kpis()
        # Last: the step is queued before the user's callback may stop training.
        self._call_on_anomaly(findings)

    def _keep(self, outcome: StepOutcome) -> bool:
        """Whether to store the step's recorded data. A dynamic step (every rank opens it
        alike) is kept on every rank if some rank keeps it: one MAX of a flag."""
        keep = outcome.recorded and outcome.keep()
        if not self._agree_keep or self.reducer.disabled is not None:
            return keep
        try:
            agreed = any_rank(self.reducer, keep)
        except CollectiveError:
            return keep  # reported once by _collectives_off
        return outcome.recorded and agreed if outcome.tentative else keep

    def _collectives_off(self, step: int) -> None:
        """Say once, in one line (a warning, and stored in the run), that deepscope's
        collectives failed and distributed instruments are off for the rest of the run."""
        reason = self.reducer.disabled
        if reason is None or "collectives off" in self._reported:
            return
        self._reported.add("collectives off")
        quantities = tuple(self.instruments.quantities) if self.instruments is not None else ()
        self.writer.submit_warnings([InstrumentWarning(step, "", quantities, reason)])
        log.warning("deepscope: rank %d: %s", self.rank, reason)

    def _check_health(self, step: int | None) -> list[Any]:
        """Store the monitor's findings (step None: what is still held, at close) and return
        them for `_call_on_anomaly`."""
        if self.monitor is None:
            return []
        result = self._guard(self.monitor.finish if step is not None else self.monitor.flush,
                             *([step] if step is not None else []))
        if result is _FAILED:
            return []
        findings, record_next = result
        self._force_record = max(self._force_record, record_next)
        if not findings:  # most steps
            return findings
        if self._world > 1:  # each rank's file: the message says which rank found it
            findings = [replace(f, message=f"rank {self.rank}: {f.message}") for f in findings]
        self.writer.submit_anomalies([(f.step, f.tensor, f.detector, f.value, f.threshold,
                                       f.message) for f in findings])
        return findings

    def _call_on_anomaly(self, findings: list[Any]) -> None:
        """The user's callback runs outside our guard so that it can stop training."""
        if self._on_anomaly is not None:
            for f in findings:
                self._on_anomaly(f)

    def _send_warnings(self, step: int) -> None:
        """Each new instrument warning: a Python warning pointing at the user's
        `with scope.step(...)` line, and a record in the run (`Run.warnings()`)."""
        found = self.instruments.take_warnings(step)
        self.writer.submit_warnings(found)  # first: a warnings filter "error" raises below
        for w in found:
            # stacklevel 6: here, _guard, _store, _end, StepRecorder.__exit__ (or end_step),
            # the user's `with` (or end_step call)
            warnings.warn(f"deepscope: {w.text()}", DeepscopeWarning, stacklevel=6)

    def _activation_hook(self, path: str, is_root: bool, sequence_first: bool) -> Callable:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            rec = self._current
            # hooks_paused: an instrument re-running a module's forward is not the user's
            if rec is not None and rec.recording and not hooks_paused():
                self._guard(rec._record_output, path, is_root, output, module, inputs,
                            sequence_first)
        return hook

    # --- failures inside recording never stop training -------------------------------------
    def _warn_once(self, message: str) -> None:
        """Log `deepscope: message` the first time this scope meets it."""
        if message not in self._reported:
            self._reported.add(message)
            log.warning("deepscope: %s", message)

    def _guard(self, fn: Callable, *args: Any) -> Any:
        try:
            return fn(*args)
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as exc:
            key = f"{type(exc).__name__}: {exc}"
            if key not in self._reported:
                self._reported.add(key)
                where = traceback.extract_tb(exc.__traceback__)[-1]
                log.warning("deepscope: recording failed (%s at %s:%d); training continues, "
                            "this step is not recorded", key, Path(where.filename).name,
                            where.lineno)
            if self._current is not None:
                self._current.recording = False
            return _FAILED

    # --- end ------------------------------------------------------------------------------
    def _send_kpis(self) -> None:
        """KPIs go to the writer in batches: one commit per second instead of one per step."""
        if self._kpi_rows:
            self.writer.submit_kpis(self._kpi_rows)
            self._kpi_rows = []
        self._kpi_sent = time.monotonic()

    def flush(self) -> None:
        """Block until every step so far is committed to disk.

        Raises `deepscope.RecordingError` naming what was not written since the last flush
        (the writer failed, or steps were skipped): a return means all of it is on disk.
        """
        self._send_kpis()
        self.writer.flush()

    def close(self, error: BaseException | None = None) -> None:
        """Commit what is queued, remove hooks, close the store. Idempotent.

        error: the exception that ended training, if one did: the run is then stored as
        "interrupted: <ErrorType>: <message>" (`Run.status`), else as "finished". Leaving a
        `with Scope(...)` block by an exception passes it.
        """
        if self.closed:
            return
        self.closed = True
        for hooks in [*self._module_hooks.values(), *self._step_hooks.values()]:
            for h in hooks:
                h.remove()
        self._module_hooks.clear()
        self._step_hooks.clear()
        self._send_kpis()
        findings = self._check_health(None)
        for part in (self.instruments, self.monitor):
            if part is not None:
                self._guard(part.close)
        self.writer.close(FINISHED if error is None else interrupted_status(error))
        self._call_on_anomaly(findings)

    def __enter__(self) -> Scope:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.close(exc)


class _Failed:
    def __repr__(self) -> str:
        return "<recording failed>"


_FAILED = _Failed()


def _params_of(model: nn.Module, names: ModelNames) -> dict[str, torch.Tensor]:
    """The parameters of `model` by their recorded names."""
    return {names.param(pname): p for pname, p in model.named_parameters()}


def _param_nodes_of(model: nn.Module, names: ModelNames, node_depth: int | None
                    ) -> dict[str, tuple[str, str]]:
    """(graph node, role in it) of each parameter of `model`, by recorded name."""
    nodes = {}
    for pname, _ in model.named_parameters():
        full = names.param(pname)
        module_parts = names.module(pname.rpartition(".")[0]).split(".")
        if node_depth is not None:
            module_parts = module_parts[:node_depth]
        nodes[full] = (".".join(module_parts), full.rpartition(".")[2])
    return nodes


def optimizer_settings(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimiser's class and its first parameter group's scalar settings (lr, momentum,
    betas, weight_decay, ...), as stored in the run's meta "optimizer"."""
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    settings: dict[str, Any] = {"type": type(optimizer).__name__}
    for key, value in group.items():
        if isinstance(value, bool | int | float) or (
                isinstance(value, tuple) and all(isinstance(v, int | float) for v in value)):
            settings[key] = value
        elif isinstance(value, torch.Tensor) and value.numel() == 1:
            settings[key] = float(value.detach().cpu())  # a tensor lr (read once, here)
    return settings


def interrupted_status(error: BaseException) -> str:
    """The stored status of a run that `error` ended: "interrupted: <ErrorType>: <line>"."""
    first_line = (str(error).splitlines() or [""])[0][:500]
    return f"{INTERRUPTED}: {type(error).__name__}" + (f": {first_line}" if first_line else "")


def _default_rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@atexit.register
def _close_open_scopes() -> None:
    """Commit queued steps of scopes the user forgot to close."""
    # After an uncaught exception the interpreter keeps it in sys.last_value before exiting.
    error = getattr(sys, "last_value", None)
    for scope in list(_open_scopes):
        try:
            scope.close(error)
        except Exception:  # noqa: BLE001 - at exit, best effort
            pass
