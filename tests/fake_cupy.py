"""A strict NumPy stand-in for CuPy: the array path that CuPy takes, run on the CPU.

``xp`` is a module-like object whose functions compute with NumPy (the same bits) on ``DeviceArray``s, a
wrapper that behaves as CuPy's arrays do towards NumPy: a NumPy function or ufunc called on one raises
TypeError (``np.exp(a)``, ``np.concatenate([a])``, ``np.asarray(a)``: CuPy refuses the implicit transfer),
an xp function or operator given a NumPy array (not a scalar) raises TypeError (CuPy does not mix them),
and the transfers are explicit: ``xp.asarray(host)`` up, ``xp.asnumpy(a)`` / ``a.get()`` down. Python and
NumPy scalars, ``int()``, ``float()``, ``len()`` and shapes pass, as on CuPy. So a module that runs on
``xp`` here makes no hidden NumPy call on a device array (tests/test_moe_xp.py).

``cupy`` is the same stand-in as CuPy itself behaves: a NumPy function or ufunc on its arrays dispatches
to the array module (NEP 13 and 18, which CuPy implements: ``np.sqrt(a)`` is a device array), while an
implicit transfer (``np.asarray(a)``, a buffer of its memory: ``a.data`` is a device pointer, not bytes)
and a host array mixed into device arithmetic still raise. It runs the whole job (engines, collectives
staged through ``Transfers``, the model) on the CPU with every transfer explicit (tests/test_gpu_path.py).
"""
import operator

import numpy as np

# NumPy names that are not array functions (dtypes, constants, ...): passed through unchanged.
_PASS = (type, np.dtype, float, int, bool)


def _un(x):
    """The NumPy array inside x (recursively through lists, tuples and dicts); TypeError for a NumPy array."""
    if isinstance(x, DeviceArray):
        return x._a
    if isinstance(x, np.ndarray):
        raise TypeError(f"a NumPy array (shape {x.shape}) given where the device array path wants a device "
                        "array: move it with xp.asarray first")
    if isinstance(x, (list, tuple)):
        return type(x)(_un(v) for v in x)
    if isinstance(x, dict):
        return {k: _un(v) for k, v in x.items()}
    return x


def _wrap(r, cls=None):
    cls = cls or DeviceArray
    if isinstance(r, np.ndarray):
        return cls(r)
    if isinstance(r, np.generic) and not isinstance(r, (np.bool_,)):
        return cls(np.asarray(r))          # CuPy's reductions give 0-d device arrays
    if isinstance(r, tuple):
        return tuple(_wrap(v, cls) for v in r)
    if isinstance(r, list):
        return [_wrap(v, cls) for v in r]
    return r


def _call(f, cls=None):
    def call(*args, **kwargs):
        return _wrap(f(*_un(args), **_un(kwargs)), cls)
    call.__name__ = getattr(f, "__name__", "call")
    return call


class DeviceArray:
    """A NumPy array that NumPy's functions refuse, as they refuse a CuPy array."""

    __array_ufunc__ = None          # np.exp(a), np.add(a, b): TypeError
    __slots__ = ("_a",)

    def __init__(self, a: np.ndarray):
        object.__setattr__(self, "_a", a)

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed (the fake CuPy): use xp.asnumpy")

    def __array_function__(self, func, types, args, kwargs):
        raise TypeError(f"numpy.{func.__name__} called on a device array (the fake CuPy): use the xp function")

    def __getattr__(self, name):
        if name.startswith("__"):   # __array_interface__, __array_struct__, ...: no back door for NumPy
            raise AttributeError(name)
        v = getattr(self._a, name)
        return _call(v, type(self)) if callable(v) else _wrap(v, type(self))

    def get(self, stream=None, order="C", out=None, blocking=True):
        """The explicit transfer down (CuPy's ``ndarray.get``: a new host array, or into ``out``)."""
        if out is None:
            return self._a.copy(order=order)
        np.copyto(out, self._a)
        return out

    def set(self, arr, stream=None):
        """The explicit transfer up (CuPy's ``ndarray.set``: a host array of this shape)."""
        np.copyto(self._a, arr)

    @property
    def data(self):
        """Device memory, as CuPy's MemoryPointer: not a buffer the host can read."""
        return _DevicePointer()

    @property
    def T(self):
        return type(self)(self._a.T)

    @property
    def shape(self):
        return self._a.shape

    @property
    def dtype(self):
        return self._a.dtype

    @property
    def ndim(self):
        return self._a.ndim

    @property
    def size(self):
        return self._a.size

    def __getitem__(self, key):
        return _wrap(self._a[_un(key)], type(self))

    def __setitem__(self, key, value):
        self._a[_un(key)] = _un(value)

    def __len__(self):
        return len(self._a)

    def __iter__(self):
        return (_wrap(v, type(self)) for v in self._a)

    def __int__(self):
        return int(self._a)

    def __float__(self):
        return float(self._a)

    def __index__(self):
        return operator.index(self._a.item())

    def __bool__(self):
        return bool(self._a)

    def __repr__(self):
        return f"DeviceArray({self._a!r})"


class _DevicePointer:
    """What ``a.data`` is on CuPy: an address on the device; hashing or writing it as bytes fails."""

    __slots__ = ()


class CupyArray(DeviceArray):
    """A device array as CuPy's are towards NumPy: NumPy's functions and ufuncs dispatch to the array module."""

    __slots__ = ()

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        out = kwargs.get("out")
        r = getattr(ufunc, method)(*_un(inputs), **_un(kwargs))
        if out is not None:
            return out[0] if len(out) == 1 else out
        return _wrap(r, CupyArray)

    def __array_function__(self, func, types, args, kwargs):
        return _wrap(func(*_un(args), **_un(kwargs)), CupyArray)


def _binary(op, reflected=False):
    def method(self, other):
        o = _un(other)
        return _wrap(op(o, self._a) if reflected else op(self._a, o), type(self))
    return method


def _inplace(op):
    def method(self, other):
        op(self._a, _un(other))
        return self
    return method


for _name, _op, _iop in (("add", operator.add, operator.iadd), ("sub", operator.sub, operator.isub),
                         ("mul", operator.mul, operator.imul), ("truediv", operator.truediv, operator.itruediv),
                         ("floordiv", operator.floordiv, operator.ifloordiv), ("mod", operator.mod, operator.imod),
                         ("pow", operator.pow, operator.ipow), ("matmul", operator.matmul, operator.imatmul),
                         ("and", operator.and_, operator.iand), ("or", operator.or_, operator.ior),
                         ("xor", operator.xor, operator.ixor)):
    setattr(DeviceArray, f"__{_name}__", _binary(_op))
    setattr(DeviceArray, f"__r{_name}__", _binary(_op, reflected=True))
    setattr(DeviceArray, f"__i{_name}__", _inplace(_iop))
for _name, _op in (("lt", operator.lt), ("le", operator.le), ("gt", operator.gt), ("ge", operator.ge),
                   ("eq", operator.eq), ("ne", operator.ne)):
    setattr(DeviceArray, f"__{_name}__", _binary(_op))
for _name, _op in (("neg", operator.neg), ("pos", operator.pos), ("abs", operator.abs),
                   ("invert", operator.invert)):
    setattr(DeviceArray, f"__{_name}__", (lambda op: lambda self: _wrap(op(self._a), type(self)))(_op))
DeviceArray.__hash__ = None


class _Pool:
    """CuPy's memory pool, as the train report reads it: nothing is pooled here."""

    def used_bytes(self) -> int:
        return 0

    def total_bytes(self) -> int:
        return 0


class FakeCupy:
    """The module: ``xp.<numpy function>`` on device arrays; ``asarray``/``array`` take host data up (a copy),
    ``asnumpy`` brings it down. ``array_type``: DeviceArray (strict) or CupyArray (as CuPy)."""

    def __init__(self, name: str = "fake_cupy", array_type=DeviceArray):
        self.__name__, self.ndarray = name, array_type

    def asarray(self, a, dtype=None):
        if isinstance(a, DeviceArray):
            return a if dtype is None or a.dtype == dtype else self.ndarray(a._a.astype(dtype))
        return self.ndarray(np.array(a, dtype=dtype, copy=True))

    def array(self, a, dtype=None, copy=True):
        if isinstance(a, DeviceArray):
            return self.ndarray(np.array(a._a, dtype=dtype, copy=copy))
        return self.ndarray(np.array(a, dtype=dtype, copy=True))

    def asnumpy(self, a):
        return a._a.copy() if isinstance(a, DeviceArray) else np.asarray(a)

    def ascontiguousarray(self, a, dtype=None):
        return self.ndarray(np.ascontiguousarray(_un(a), dtype))

    def get_default_memory_pool(self) -> _Pool:
        return _Pool()

    def __getattr__(self, name):
        v = getattr(np, name)
        if isinstance(v, _PASS) or not callable(v):
            return v
        return _call(v, self.ndarray)


xp = FakeCupy()
cupy = FakeCupy("fake_cupy_dispatching", CupyArray)


class Transfers:
    """comm/staging.py's device copies for ``cupy`` arrays: explicit, counted, no pinned memory."""

    name = "stand-in"

    def __init__(self):
        self.to_host_bytes = self.to_device_bytes = 0

    def pinned(self, numel: int, dtype) -> np.ndarray:
        return np.empty(numel, dtype)

    def to_host(self, dev, host) -> None:
        np.copyto(host, dev._a)
        self.to_host_bytes += host.nbytes

    def to_device(self, host, dev) -> None:
        np.copyto(dev._a, host)
        self.to_device_bytes += host.nbytes

    def synchronize(self) -> None:
        pass


def install() -> Transfers:
    """Make zerompi take ``cupy`` for CuPy in this process (a driver's first step): its device communicators stage
    through a Transfers (returned, counting the bytes); optim/impl recognises a ``cupy`` array as a device one,
    and the CUDA kernels it then calls for one (the quantization's) compute their references' bits
    (tests/test_kernels.py) on copies. The CPU's paths are unchanged."""
    from zerompi.comm import staging
    from zerompi.optim import cuda, impl, reference
    transfers, host_communicator = Transfers(), staging.device_communicator
    host_module, host_copy = impl.array_module, impl.to_host

    def device_communicator(host, xp, comm="mpi", timeout_s=None):
        return staging.StagedCommunicator(host, transfers) if xp is cupy else host_communicator(host, xp, comm,
                                                                                                timeout_s)

    def quantize_kernel(x, bits, block):
        q, scales = reference.quantize_reference(x.get(), bits, block)
        return cupy.asarray(q), cupy.asarray(scales)

    def dequant_sum_kernel(q_rows, scale_rows, n, bits, block, out, scale, accumulate):
        host = out.get()
        reference.dequant_sum_reference([q.get() for q in q_rows], [s.get() for s in scale_rows], n, bits, block,
                                        host, scale, accumulate)
        out[...] = cupy.asarray(host)

    staging.device_communicator = device_communicator
    impl.array_module = lambda a: cupy if isinstance(a, CupyArray) else host_module(a)
    impl.to_host = lambda a: a.get() if isinstance(a, CupyArray) else host_copy(a)
    impl.is_device = lambda a: isinstance(a, CupyArray)
    cuda.quantize_fused_gpu, cuda.dequant_sum_fused_gpu = quantize_kernel, dequant_sum_kernel
    return transfers
