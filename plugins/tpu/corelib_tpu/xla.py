"""The few torch-xla calls the plugin makes, imported lazily, and no-ops on other devices.

The sampler also runs on a plain torch device (``TpuSampler("cpu")``): the same traced code
executes eagerly, which is how its logic is tested without torch-xla.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Hashable, Optional, Sequence

import torch

#: torch-xla's counter of graphs compiled (not found in its in-memory graph cache).
COMPILE_COUNTER = "UncachedCompile"


class RecompilationError(RuntimeError):
    """A strict sampler compiled a graph after its warm-up."""


def is_xla(device: torch.device) -> bool:
    return torch.device(device).type == "xla"


#: XLA:CPU options the plugin chooses where the caller's XLA_FLAGS leave them open
#: (``choose_cpu_codegen``): the option's name -> the flag added.
CPU_CODEGEN_FLAGS = {
    # the older kernel emitter: a graph's fusions in a few modules, not one module each
    "xla_cpu_use_fusion_emitters": "--xla_cpu_use_fusion_emitters=false",
    # a row reduction over V as one vectorised loop, not a tree of reduce-window kernels
    "xla_disable_hlo_passes": "--xla_disable_hlo_passes=tree_reduction_rewriter",
}
#: torch-xla releases whose XLA knows those options (an unknown one in XLA_FLAGS aborts the process).
CPU_CODEGEN_RELEASES = ("2.9.",)


def choose_cpu_codegen() -> tuple[str, ...]:
    """On XLA:CPU (``PJRT_DEVICE=CPU``), before torch-xla's runtime starts, add each flag of
    ``CPU_CODEGEN_FLAGS`` to ``XLA_FLAGS`` whose option they do not set already; returns the
    flags added (empty: none). XLA reads ``XLA_FLAGS`` once, when the runtime starts, so after
    that (a caller that used XLA first) this changes nothing.

    Why: XLA:CPU keeps the code of every compiled kernel in memory maps of its own (about three
    each) for as long as the graph lives, and the kernel's default ``vm.max_map_count`` is 65530.
    Its fusion emitters compile each fusion as a kernel apart; the older emitter puts a graph's
    fusions into a few modules. Its tree reduction rewriter turns each reduction over a row of
    V values into ceil(log32 V) levels of reduce-window kernels (three at V = 128256); a folded
    random step graph holds about 90 row reductions (softmax maxima and sums, thresholds,
    counts), most of them inside its filters' conditionals. With both flags the bucket-8 random
    graph maps 442 regions at V = 128256 instead of 1,469 (1,965 with neither), which is what
    lets the documented warm-up fit a default-configured machine (docs/benchmarks-tpu.md). A
    TPU keeps its executables on the device: nothing is changed there."""
    if os.environ.get("PJRT_DEVICE", "").strip().upper() != "CPU":
        return ()
    flags = os.environ.get("XLA_FLAGS", "")
    missing = tuple(flag for option, flag in CPU_CODEGEN_FLAGS.items() if option not in flags)
    if not missing:
        return ()
    import torch_xla
    if (not torch_xla.__version__.startswith(CPU_CODEGEN_RELEASES)
            or torch_xla._XLAC._xla_runtime_is_initialized()):
        return ()
    os.environ["XLA_FLAGS"] = " ".join((flags, *missing)).strip()
    return missing


def default_device() -> torch.device:
    """The first XLA device (imports torch-xla)."""
    import torch_xla
    return torch.device(torch_xla.device())


def launch(tensors: Sequence[torch.Tensor]) -> None:
    """Compile (if new) and start the graph computing ``tensors``, without waiting for it.

    Only these tensors' pending operations are cut into the graph, so a graph holds exactly
    one sampler operation whatever else the caller has pending. No-op off XLA.
    """
    tensors = [t for t in tensors if t.device.type == "xla"]
    if tensors:
        import torch_xla
        torch_xla._XLAC._xla_sync_multi(tensors, devices=[], wait=False)


def fetch(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The launched ``tensors`` as CPU tensors, read back in one call (one wait on the
    device for all of them); off XLA, ``.cpu()`` of each."""
    if tensors and all(t.device.type == "xla" for t in tensors):
        import torch_xla
        return list(torch_xla._XLAC._xla_get_cpu_tensors(list(tensors)))
    return [t.cpu() for t in tensors]


def bitcast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret the bits of ``tensor`` as ``dtype`` (same element size); not a copy off XLA.

    On XLA this is a one-op user computation (``BitcastConvert``) inside the lazy graph:
    torch-xla 2.9 runs ``Tensor.view(dtype)`` eagerly, which would cut every graph in two at
    each bitcast. The computation is built once per input shape and type.
    """
    if tensor.device.type != "xla":
        return tensor.view(dtype)
    import torch_xla
    import torch_xla.core.xla_builder as xb
    shape = xb.tensor_shape(tensor)
    key = (tuple(tensor.shape), tensor.dtype, dtype)
    computation = _BITCASTS.get(key)
    if computation is None:
        target = xb._PT_XLA_TYPE_MAP[dtype]
        computation = xb.create_computation("bitcast", lambda p: p.bitcast(target), [shape])
        _BITCASTS[key] = computation
    return torch_xla._XLAC._xla_user_computation("xla::bitcast", [tensor], computation)[0]


_BITCASTS: dict = {}


def iota(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.arange(n)`` as a ``[1, n]`` tensor on ``device``, made once and reused.

    torch-xla builds ``arange`` on the host and uploads it at every call (10 to 50 ms for a
    128k vocabulary); a cached tensor enters each graph as an input instead.
    """
    key = (n, dtype, str(device))
    tensor = _IOTAS.get(key)
    if tensor is None:
        tensor = torch.arange(n, dtype=dtype)[None, :].to(device)
        _IOTAS[key] = tensor
    return tensor


_IOTAS: dict = {}


def cond(pred: torch.Tensor, true_fn: Callable[..., Branch], false_fn: Callable[..., Branch],
         operands: Sequence[torch.Tensor], key: Hashable) -> Branch:
    """``true_fn(*operands)`` where the bool 0-d ``pred`` holds, else ``false_fn(*operands)``:
    both return a tensor, or a tuple of tensors of the same shapes and dtypes.

    On XLA this is one ``Conditional`` inside the lazy graph: both branches are compiled with
    the graph, only the taken one runs, and the predicate is never read on the host (torch's
    ``cond`` is, in torch-xla 2.9's lazy mode). Each branch is traced once per (``key``,
    operand shapes and dtypes) and reused, so ``key`` must name everything besides the
    operands that the branches depend on (Python values baked into them). A branch may read
    the operands, Python scalars, and cached iotas (``iota``); it must not read any other
    tensor, since a reused trace would keep reading its first value (one of more than 0
    dimensions raises ValueError). Off XLA the predicate is read and the branch runs eagerly.
    """
    if pred.device.type != "xla" or _EAGER[0]:
        return (true_fn if bool(pred) else false_fn)(*operands)
    import torch_xla
    cache_key = (key, _signature(operands))
    entry = _CONDS.get(cache_key)
    if entry is None:
        entry = _CONDS[cache_key] = _build_cond(true_fn, false_fn, operands, key)
    computation, inputs, single = entry
    args = [pred] + [operands[i] if isinstance(i, int) else i for i in inputs]
    outs = torch_xla._XLAC._xla_user_computation("xla::corelib_cond", args, computation)
    return outs[0] if single else tuple(outs)


def switch(index: torch.Tensor, branches: Sequence[Callable[..., Branch]],
           operands: Sequence[torch.Tensor], key: Hashable) -> Branch:
    """``branches[index](*operands)`` for an int 0-d ``index`` (out of range: the last
    branch), as nested ``cond``s: one graph, only the chosen branch runs."""
    if len(branches) == 1:
        return branches[0](*operands)
    first = lambda i, *ops: branches[0](*ops)                                      # noqa: E731
    rest = lambda i, *ops: switch(i - 1, branches[1:], ops, key)                    # noqa: E731
    return cond(index == 0, first, rest, [index, *operands], (key, len(branches)))


def fori_loop(steps: int, body: Callable[..., tuple], carry: Sequence[torch.Tensor],
              operands: Sequence[torch.Tensor], key: Hashable,
              live: Optional[int] = None) -> tuple[torch.Tensor, ...]:
    """``carry = body(*carry, *operands)`` ``steps`` times (``steps`` a Python int); returns
    the last carry, a tuple of tensors of the shapes and dtypes of ``carry``. live: None, or
    the index in ``carry`` of a 0-d bool: the loop also stops as soon as it is False (checked
    on the device before each step), for a body that knows when further steps change nothing.

    On XLA this is one ``While`` inside the lazy graph whose body is compiled once, where
    unrolling would paste ``steps`` copies of it into the graph (compile time grows with the
    graph). The body is traced as a ``cond`` branch is, with the same rules: once per
    (``key``, ``steps``, shapes and dtypes), reading only its arguments, Python scalars and
    cached iotas. Off XLA the loop runs eagerly."""
    carry = tuple(carry)
    if not carry or carry[0].device.type != "xla" or _EAGER[0]:
        for _ in range(steps):
            if live is not None and not bool(carry[live]):
                break
            carry = tuple(body(*carry, *operands))
        return carry
    import torch_xla
    tensors = [*carry, *operands]
    cache_key = (key, steps, len(carry), live, _signature(tensors))
    entry = _LOOPS.get(cache_key)
    if entry is None:
        entry = _LOOPS[cache_key] = _build_loop(steps, body, tensors, len(carry), key, live)
    computation, inputs = entry
    args = [tensors[i] if isinstance(i, int) else i for i in inputs]
    return tuple(torch_xla._XLAC._xla_user_computation("xla::corelib_loop", args, computation))


@contextmanager
def eager_branches():
    """Inside it, ``cond`` and ``fori_loop`` on XLA read their predicate on the host and run
    the chosen branch (each loop step) as ordinary lazy operations, as they do off XLA: a
    user computation has no autograd formula, so this is how a ``score`` whose logits
    require grad runs the same stages differentiably (one host read per conditional; the
    graphs it cuts are compiled per shape, outside warm-up)."""
    previous, _EAGER[0] = _EAGER[0], True
    try:
        yield
    finally:
        _EAGER[0] = previous


_EAGER = [False]
Branch = "torch.Tensor | tuple[torch.Tensor, ...]"
_CONDS: dict = {}
_LOOPS: dict = {}


def _build_cond(true_fn, false_fn, operands: Sequence[torch.Tensor], key: Hashable) -> tuple:
    """The ``Conditional`` computation of ``cond``, and the tensors to pass it after the
    predicate: operand indices, or captured scalars and iotas."""
    import torch_xla
    import torch_xla.core.xla_builder as xb
    t_comp, t_inputs, t_outs = _trace_branch(true_fn, operands, key)
    f_comp, f_inputs, f_outs = _trace_branch(false_fn, operands, key)
    if t_outs != f_outs:
        raise ValueError(f"cond {key!r}: the branches return different shapes or dtypes: "
                         f"{t_outs} and {f_outs}")
    builder = xb.create_builder("corelib_cond")
    pred = xb.mkparam(builder, 0, xb.Shape.create(xb.Type.PRED, []))
    params = _parameters(builder, t_inputs + f_inputs, operands, first=1)
    true_params, false_params = params[:len(t_inputs)], params[len(t_inputs):]
    # Each branch's operand tuple leads with the predicate, so that a branch that reads
    # nothing still has an operand to find its builder by.
    def caller(computation):
        def call(first, *inputs):
            return xb.Op.call(computation, list(inputs),
                              builder=torch_xla._XLAC._xla_op_builder(first.op))
        return call

    result = pred.conditional(xb.Op.tuple([pred] + true_params, builder=builder),
                              xb.Op.tuple([pred] + false_params, builder=builder),
                              caller(t_comp), caller(f_comp))
    return result.build("corelib_cond"), t_inputs + f_inputs, t_outs[0] is None


def _build_loop(steps: int, body, tensors: Sequence[torch.Tensor], n_carry: int,
                key: Hashable, live: Optional[int] = None) -> tuple:
    """The ``While`` computation of ``fori_loop`` and the tensors to pass it: the carry, then
    the body's other inputs (operand indices, or captured scalars and iotas)."""
    import torch_xla.core.xla_builder as xb
    traced, body_inputs, outs = _trace_branch(body, tensors, key)
    described = outs[1:] if outs and outs[0] is None else outs
    expected = [(tuple(t.shape), t.dtype) for t in tensors[:n_carry]]
    if described != expected:
        raise ValueError(f"fori_loop {key!r}: the body returns {described}, not the carry's "
                         f"shapes and dtypes {expected}")
    constants = [i for i in body_inputs if not (isinstance(i, int) and i < n_carry)]
    inputs = list(range(n_carry)) + constants
    builder = xb.create_builder("corelib_loop")
    state = [xb.Op.scalar(builder, 0, dtype=xb.Type.S64)] + _parameters(builder, inputs, tensors, first=0)
    # where each of the traced body's parameters sits in the loop state (after the counter)
    position = {id(i): n_carry + j for j, i in enumerate(constants)}
    slots = [1 + (i if isinstance(i, int) and i < n_carry else position[id(i)])
             for i in body_inputs]

    def condition(counter, *rest):
        more = counter < counter.scalar_like(steps)
        return more if live is None else more & rest[live]

    def step(counter, *rest):
        elements = (counter, *rest)
        result = xb.Op.call(traced, [elements[k] for k in slots], builder=counter.builder())
        new_carry = [result.get_tuple_element(k) for k in range(n_carry)]
        return xb.Op.tuple([counter + counter.scalar_like(1), *new_carry, *rest[n_carry:]])

    looped = xb.Op.tuple(state, builder=builder).while_loop(condition, step)
    root = xb.Op.tuple([looped.get_tuple_element(1 + k) for k in range(n_carry)], builder=builder)
    return root.build("corelib_loop"), inputs


def _parameters(builder, inputs: list, operands: Sequence[torch.Tensor], first: int) -> list:
    """The parameters ``first``, ``first + 1``, ... of a computation built around traced
    bodies, one per input (an operand index, or a captured scalar or iota), each in the type
    its body was traced with: torch-xla may hold an operand in a wider XLA type than its torch
    dtype, and the placeholder had the torch dtype's type."""
    import torch_xla.core.xla_builder as xb
    params = []
    for j, i in enumerate(inputs):
        tensor = operands[i] if isinstance(i, int) else i
        held = xb.tensor_shape(tensor)
        param = xb.mkparam(builder, first + j, held)
        traced = xb._PT_XLA_TYPE_MAP[tensor.dtype]
        params.append(param.cast(traced) if isinstance(i, int) and held.dtype != traced else param)
    return params


def _signature(tensors: Sequence[torch.Tensor]) -> tuple:
    """What a traced body depends on besides its key: each operand's shape, dtype and the
    XLA type torch-xla holds it in (its int32 hash arithmetic runs in s64, and the
    computation converts)."""
    import torch_xla.core.xla_builder as xb
    return tuple((tuple(t.shape), t.dtype, xb.tensor_shape(t).dtype) for t in tensors)


def _trace_branch(fn, operands: Sequence[torch.Tensor], key: Hashable) -> tuple:
    """One branch traced on placeholders of the operands: (computation, its inputs in
    parameter order, the shapes and dtypes it returns; a leading None when it returns one
    tensor rather than a tuple)."""
    import torch_xla
    import torch_xla.core.xla_builder as xb
    fakes = [xb.create_placeholder_tensor(t.shape, t.dtype) for t in operands]
    out = fn(*fakes)
    single = isinstance(out, torch.Tensor)
    outs = [out] if single else list(out)
    context = torch_xla._XLAC.lowering.LoweringContext("corelib_branch")
    context.build(outs)
    computation = xb.computation_from_module_proto("corelib_branch", context.hlo())
    captured = context.device_parameter_id_tensor_mapping()
    inputs: list = [None] * len(captured)
    for i, fake in enumerate(fakes):
        parameter = context.tensor_parameter_id(fake)
        if parameter != -1:
            inputs[parameter] = i
            del captured[parameter]
    handles = torch_xla._XLAC._get_tensors_handle
    cached = [t for t in _IOTAS.values() if t.device.type == "xla"]
    iotas = set(handles(cached)) if cached else set()
    for parameter, tensor in captured.items():
        if tensor.dim() != 0 and handles([tensor])[0] not in iotas:
            raise ValueError(f"cond {key!r}: a branch reads a {list(tensor.shape)} "
                             f"{tensor.dtype} tensor it was not given; pass it as an operand")
        inputs[parameter] = tensor
    described = [(tuple(o.shape), o.dtype) for o in outs]
    return computation, inputs, ([None] if single else []) + described


#: Environment variable naming the persistent compile cache's directory (``compile_cache``).
CACHE_ENV = "CORELIB_TPU_COMPILE_CACHE"


def default_cache_dir() -> Path:
    """Where ``compile_cache(True)`` keeps compiled graphs: ``$XDG_CACHE_HOME/corelib/xla``
    (``~/.cache/corelib/xla`` without it), one folder per torch-xla version, since a graph
    compiled by one version is not loaded by another."""
    import torch_xla
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "corelib" / "xla" / f"torch_xla-{torch_xla.__version__}"


def compile_cache(path: "str | os.PathLike | bool | None" = None, readonly: bool = False) -> Optional[Path]:
    """Switch on torch-xla's persistent compile cache for this process, so that a later
    process compiling the same graphs loads them from disk instead (``torch_xla.runtime.
    initialize_cache``). path: a directory, True for ``default_cache_dir()``, None for the
    ``CORELIB_TPU_COMPILE_CACHE`` environment variable (unset or empty: off), False for off
    (both return None).
    readonly: load from the cache without adding to it (workers sharing one directory).

    Must come before this process's first XLA computation, as torch-xla requires; a later
    call with the directory already in use returns it, one with another directory raises
    RuntimeError. Returns the directory in use."""
    if path is None:
        path = os.environ.get(CACHE_ENV) or None
    if path is None or path is False:
        return None
    import torch_xla
    import torch_xla.runtime as xr
    directory = default_cache_dir() if path is True else Path(path).expanduser()
    current = os.environ.get("XLA_PERSISTENT_CACHE_PATH")
    if torch_xla._XLAC._xla_computation_cache_is_initialized():
        if current and Path(current) == directory:
            return directory
        raise RuntimeError(
            f"compile_cache({str(directory)!r}): this process already ran XLA computations "
            f"{'with the cache in ' + repr(current) if current else 'without a persistent cache'}; "
            f"switch it on before the first one (create the TpuSampler with compile_cache=..., "
            f"or set {CACHE_ENV} before starting)")
    directory.mkdir(parents=True, exist_ok=True)
    xr.initialize_cache(str(directory), readonly=readonly)
    return directory


def persistent_cache_hits() -> int:
    """Graphs loaded from the persistent compile cache so far in this process."""
    return _counter("PersistentCacheHit")


def compile_count() -> int:
    """Graphs compiled so far in this process (0 when torch-xla is not loaded)."""
    return _counter(COMPILE_COUNTER)


def _counter(name: str) -> int:
    """torch-xla's counter ``name`` (0 when torch-xla is not loaded or it never counted)."""
    if "torch_xla" not in sys.modules:
        return 0
    import torch_xla.debug.metrics as met
    return int(met.counter_value(name) or 0)


class CompileGuard:
    """Counts the graphs a sampler's operations compile; in strict mode, once armed (after
    warm-up), raises ``RecompilationError`` naming the operation that compiled one.

    Shared by a sampler and its batches, so adds, removes and appends are watched too.
    """

    def __init__(self, strict: bool = False):
        self.strict = strict
        self.armed = False
        self.compiled_after_warmup = 0

    @contextmanager
    def watch(self, operation: str):
        before = compile_count()
        yield
        new = compile_count() - before
        if new and self.armed:
            self.compiled_after_warmup += new
            if self.strict:
                raise RecompilationError(
                    f"{operation} compiled {new} new XLA graph(s) after warmup(); warm up with "
                    f"the shapes, dtypes and logits layouts used in serving (see docs/tpu.md)")


def padded_block(tensor: torch.Tensor, shape: Sequence[int], fill, dtype: torch.dtype) -> torch.Tensor:
    """A new ``dtype`` tensor of ``shape`` filled with ``fill``, ``tensor`` in its leading
    corner (each dimension of ``tensor`` at most ``shape``'s), on ``tensor``'s device."""
    out = torch.full(tuple(shape), fill, dtype=dtype, device=tensor.device)
    out[tuple(slice(0, size) for size in tensor.shape)] = tensor.to(dtype)
    return out


def fit_block(tensor: torch.Tensor, shape: Sequence[int], fill, dtype: torch.dtype,
              device: torch.device, guard: "CompileGuard", what: str) -> torch.Tensor:
    """``tensor`` as ``dtype`` ``shape`` on ``device`` (``padded_block``): a host tensor is
    padded on the host and uploaded without blocking; a device tensor of another shape or
    dtype goes through a one-op graph (one per input shape and dtype, watched as ``what``);
    one that already fits is returned as it is."""
    if tuple(tensor.shape) == tuple(shape) and tensor.dtype == dtype:
        return tensor.to(device, non_blocking=True)
    padded = padded_block(tensor, shape, fill, dtype)
    if tensor.device.type == "cpu":
        return padded.to(device, non_blocking=True)
    with guard.watch(what):
        launch([padded])
    return padded
