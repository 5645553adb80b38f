"""A strict NumPy stand-in for CuPy: the array path that CuPy takes, run on the CPU.

``xp`` is a module-like object whose functions compute with NumPy (the same bits) on ``DeviceArray``s, a
wrapper that behaves as CuPy's arrays do towards NumPy: a NumPy function or ufunc called on one raises
TypeError (``np.exp(a)``, ``np.concatenate([a])``, ``np.asarray(a)``: CuPy refuses the implicit transfer),
an xp function or operator given a NumPy array (not a scalar) raises TypeError (CuPy does not mix them),
and the transfers are explicit: ``xp.asarray(host)`` up, ``xp.asnumpy(a)`` / ``a.get()`` down. Python and
NumPy scalars, ``int()``, ``float()``, ``len()`` and shapes pass, as on CuPy. So a module that runs on
``xp`` here makes no hidden NumPy call on a device array (tests/test_moe_xp.py).
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


def _wrap(r):
    if isinstance(r, np.ndarray):
        return DeviceArray(r)
    if isinstance(r, np.generic) and not isinstance(r, (np.bool_,)):
        return DeviceArray(np.asarray(r))          # CuPy's reductions give 0-d device arrays
    if isinstance(r, tuple):
        return tuple(_wrap(v) for v in r)
    if isinstance(r, list):
        return [_wrap(v) for v in r]
    return r


def _call(f):
    def call(*args, **kwargs):
        return _wrap(f(*_un(args), **_un(kwargs)))
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
        return _call(v) if callable(v) else _wrap(v)

    def get(self):
        """The explicit transfer down (CuPy's ``ndarray.get``)."""
        return self._a.copy()

    @property
    def T(self):
        return DeviceArray(self._a.T)

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
        return _wrap(self._a[_un(key)])

    def __setitem__(self, key, value):
        self._a[_un(key)] = _un(value)

    def __len__(self):
        return len(self._a)

    def __iter__(self):
        return (_wrap(v) for v in self._a)

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


def _binary(op, reflected=False):
    def method(self, other):
        o = _un(other)
        return _wrap(op(o, self._a) if reflected else op(self._a, o))
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
    setattr(DeviceArray, f"__{_name}__", (lambda op: lambda self: _wrap(op(self._a)))(_op))
DeviceArray.__hash__ = None


class FakeCupy:
    """The module: ``xp.<numpy function>`` on device arrays; ``asarray``/``array`` take host data up (a copy),
    ``asnumpy`` brings it down."""

    __name__ = "fake_cupy"
    ndarray = DeviceArray

    def asarray(self, a, dtype=None):
        if isinstance(a, DeviceArray):
            return a if dtype is None or a.dtype == dtype else DeviceArray(a._a.astype(dtype))
        return DeviceArray(np.array(a, dtype=dtype, copy=True))

    def array(self, a, dtype=None, copy=True):
        if isinstance(a, DeviceArray):
            return DeviceArray(np.array(a._a, dtype=dtype, copy=copy))
        return DeviceArray(np.array(a, dtype=dtype, copy=True))

    def asnumpy(self, a):
        return a._a.copy() if isinstance(a, DeviceArray) else np.asarray(a)

    def ascontiguousarray(self, a, dtype=None):
        return DeviceArray(np.ascontiguousarray(_un(a), dtype))

    def __getattr__(self, name):
        v = getattr(np, name)
        if isinstance(v, _PASS) or not callable(v):
            return v
        return _call(v)


xp = FakeCupy()
