"""Unpickle checkpoint files without running code from them.

A pickle is a program: its opcodes name globals and call them (`REDUCE`, `NEWOBJ`), and set state
on what they built (`BUILD`). `SafeUnpickler` runs that program on Python's own pure-Python
pickle machine with every dangerous opcode replaced:

- globals resolve through an exact `(module, name)` table, never by import, so a dotted name or a
  look-alike module is simply unknown;
- what a global resolves to is chosen here, not by the file: plain containers and torch/numpy
  value types, checked wrappers (`_codecs.encode` accepts only latin-1, `numpy.dtype` refuses
  object dtypes, `getattr` gives only an enum member by name), and *stand-ins* for the few
  DeepSpeed classes found in its checkpoints (`PickledObject`: the class name, constructor
  arguments and state, kept as data);
- `REDUCE` and `NEWOBJ` call only callables from that table; `BUILD` sets state only on instances
  of the few types that need it, never on a class; protocol-0/1 instantiation (`INST`, `OBJ`),
  the extension registry (`EXT*`) and out-of-band buffers are refused.

A stand-in becomes a real DeepSpeed object only where one is needed (resuming into an engine),
through `ucp_deepspeed.compat.rebuild`. Users who trust a file with other classes in it (their own
`client_state` objects, say) name each one exactly in `UCP_ALLOW_PICKLE=module.Name,...`.
"""

from __future__ import annotations

import collections
import enum
import importlib
import io
import os
import pickle
import reprlib
import sys
import types
from collections.abc import Callable
from typing import Any, ClassVar

import torch

ALLOW_ENV = "UCP_ALLOW_PICKLE"


class UnsafePickle(pickle.UnpicklingError):
    """The pickle asked for something this unpickler does not do; the message says what."""


class _Sealed(type):
    """Metaclass of stand-in types: a pickle cannot set attributes on the class itself."""

    def __setattr__(cls, name: str, value: Any) -> None:
        raise AttributeError(f"{cls.__name__} is read-only")

    def __delattr__(cls, name: str) -> None:
        raise AttributeError(f"{cls.__name__} is read-only")


class PickledObject(metaclass=_Sealed):
    """An object of an allowed class, kept as data: `qualname`, constructor `args` and `state`.

    Attribute reads fall through to the state, so code that only reads fields (such as
    `fragment_address.start`) works on the stand-in as on the real object.
    """

    qualname: ClassVar[str] = ""
    __slots__ = ("args", "state")

    def __new__(cls, *args: Any) -> PickledObject:
        obj = object.__new__(cls)
        object.__setattr__(obj, "args", args)
        object.__setattr__(obj, "state", None)
        return obj

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a stand-in for {self.qualname} is read-only")

    def __getattr__(self, name: str) -> Any:
        state = object.__getattribute__(self, "state")
        if isinstance(state, dict) and name in state:
            return state[name]
        raise AttributeError(f"{self.qualname} stand-in has no field {name!r}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PickledObject) and (self.qualname, self.args, self.state) == (
            other.qualname,
            other.args,
            other.state,
        )

    def __hash__(self) -> int:
        return hash((self.qualname, self.args))

    def __repr__(self) -> str:
        return f"<{self.qualname} {self.state if self.state is not None else self.args}>"

    def to_data(self) -> dict[str, Any]:
        """A plain-data form that `torch.save` can write without naming this module."""
        return {"__class__": self.qualname, "args": list(self.args), "state": self.state}


_STANDINS: dict[str, Any] = {}


def standin(qualname: str) -> Any:
    """The stand-in type for a class, one per qualified name."""
    if qualname not in _STANDINS:
        _STANDINS[qualname] = _Sealed(
            qualname.rsplit(".", 1)[-1], (PickledObject,), {"qualname": qualname, "__slots__": ()}
        )
    return _STANDINS[qualname]


# Classes found in DeepSpeed's checkpoint files; kept as stand-ins when read (see `compat.rebuild`).
DEEPSPEED_CLASSES = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


# Classes other stacks pickle into the files they hand DeepSpeed, kept as stand-ins and never built, each with its
# members' values by name (early Python 3.11 pickles a member by name: `member_by_name`): Megatron-DeepSpeed saves its
# `args` (an argparse.Namespace) into every model-states file, with the model's type as megatron-core's enum, and
# BigScience's fork (which trained BLOOM) with the position embedding's type as its own enum
RECORD_CLASSES: dict[str, dict[str, int]] = {
    # megatron-core's model types, past ones included (a record of an older run)
    "megatron.core.enums.ModelType": {
        "encoder_or_decoder": 1,
        "encoder_and_decoder": 2,
        "retro_encoder": 3,
        "retro_decoder": 4,
    },
    "megatron.enums.PositionEmbeddingType": {"rotary": 1, "absolute": 2, "alibi": 3},
}


class StorageType:
    """What a pickled storage class (`torch.FloatStorage`, ...) means to a reader: its element dtype."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype


class TensorType:
    """What `torch.Tensor` / `torch.nn.Parameter` mean inside `_rebuild_from_type_v2`: only a marker."""

    __slots__ = ()


_TENSOR_TYPE = TensorType()

_LEGACY_STORAGES = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
    "UntypedStorage": torch.uint8,
}


def _refuse(what: str) -> Any:
    raise UnsafePickle(what)


def _latin1(text: Any, encoding: Any = "latin1") -> bytes:
    """`_codecs.encode` as protocol 2 uses it for bytes; other codecs could import modules."""
    if type(text) is not str or encoding not in ("latin1", "latin-1"):
        _refuse(f"_codecs.encode with {type(text).__name__} and encoding {encoding!r}")
    encoded: bytes = text.encode("latin1")
    return encoded


def _empty_bytes(*args: Any) -> bytes:
    """`bytes()` as protocol 2 writes an empty bytes object; `bytes(n)` would allocate n bytes."""
    if args:
        _refuse("bytes() with arguments")
    return b""


def _bytearray(data: Any = b"") -> bytearray:
    if type(data) is not bytes:
        _refuse(f"bytearray({type(data).__name__})")
    return bytearray(data)


_FACTORIES = (None, list, dict, set, int, float, str, tuple, collections.OrderedDict)


def _defaultdict(factory: Any = None) -> collections.defaultdict[Any, Any]:
    if not any(factory is f for f in _FACTORIES):
        _refuse(f"defaultdict with default factory {factory!r}")
    return collections.defaultdict(factory)


def zero_stage(value: Any) -> int:
    """DeepSpeed's `ZeroStageEnum(value)`, read as the plain int it is (its members compare as ints), which no
    pickle can then set state on."""
    if type(value) is not int or value not in range(4):
        _refuse(f"ZeroStageEnum({value!r})")
    return int(value)


# Early Python 3.11 releases (Debian 12's 3.11.2 among them) pickle an enum member by name, `getattr(Enum, "NAME")`,
# where others call the class with its value: DeepSpeed's ZeRO stages by name, read as the value would be
_ZERO_STAGES = {"disabled": 0, "optimizer_states": 1, "gradients": 2, "weights": 3, "max_stage": 3}


def member_by_name(*args: Any) -> Any:
    """`getattr` as a pickle calls it for an enum member by name: only a member of an enum already allowed, never any
    other attribute (a method, a dunder) of anything."""
    if len(args) != 2:
        _refuse(f"getattr with {len(args)} arguments")
    owner, name = args
    members: dict[str, Any]
    if owner is zero_stage:
        what, members = "ZeroStageEnum", dict(_ZERO_STAGES)
    elif isinstance(owner, type) and issubclass(owner, PickledObject):
        what, members = owner.qualname, {n: owner(v) for n, v in RECORD_CLASSES.get(owner.qualname, {}).items()}
    elif isinstance(owner, enum.EnumMeta):
        what, members = owner.__qualname__, dict(owner.__members__)
    else:
        what, members = owner.__qualname__ if isinstance(owner, type) else type(owner).__name__, {}
    if type(name) is not str or name not in members:
        _refuse(f"getattr({what}, {reprlib.repr(name)}): not a member of an enum this reader keeps")
    return members[name]


def _numpy() -> Any:
    import numpy

    return numpy


_NUMERIC = "biufc"
"""The numpy dtype kinds a pickle may build (bool, integers, floats, complex), each only from the state numpy pickles
for a plain number (`_plain_dtype_state`): a dtype takes flags, sub-arrays and fields from a pickle's state, and one
that says it holds objects, or more bytes than it has, reads raw bytes as pointers or past their end."""


def _np_dtype(*args: Any) -> Any:
    dtype = _numpy().dtype(*args)
    if dtype.kind not in _NUMERIC:
        _refuse(f"numpy dtype {dtype} is not a number type")
    return dtype


def _np_reconstruct(subtype: Any, shape: Any, code: Any) -> Any:
    """numpy's first step in unpickling an array: an empty one, filled in by BUILD (which checks sizes)."""
    np = _numpy()
    if subtype is not np.ndarray or shape != (0,):
        _refuse(f"numpy _reconstruct of {subtype!r} with shape {shape!r}")
    return np.ndarray.__new__(np.ndarray, shape, _np_dtype(code))


def _plain_dtype_state(state: Any) -> bool:
    """Whether `state` is what numpy pickles for a plain number dtype: a byte order and nothing else. Anything more
    (a sub-array shape, fields, flags, metadata) would make the dtype describe bytes it does not have, or objects."""
    return (
        isinstance(state, tuple)
        and len(state) in (8, 9)
        and state[0] in (3, 4)
        and state[1] in ("<", ">", "|", "=")
        and state[2:5] == (None, None, None)
        and state[5:8] == (-1, -1, 0)
        and (len(state) == 8 or state[8] is None)
    )


def _np_scalar(dtype: Any, data: Any = None) -> Any:
    np = _numpy()
    if not isinstance(dtype, np.dtype) or dtype.kind not in _NUMERIC or type(data) is not bytes:
        _refuse("numpy scalar of a type that is not a number")
    if dtype.subdtype is not None or dtype.names is not None or dtype.metadata or dtype.itemsize != len(data):
        _refuse(f"numpy scalar of {len(data)} bytes with a dtype that does not describe them")
    return np.frombuffer(data, dtype=dtype, count=1)[0]


def _dtypes() -> dict[str, torch.dtype]:
    return {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)}


_BUILTINS = {
    "set": set,
    "frozenset": frozenset,
    "complex": complex,
    "slice": slice,
    "bytes": _empty_bytes,
    "bytearray": _bytearray,
    "list": list,
    "dict": dict,
    "tuple": tuple,
    "int": int,
    "float": float,
    "str": str,
    "bool": bool,
}

# (module, name) -> what the pickle gets; a callable value of `_LAZY` is resolved on first use
_TABLE: dict[tuple[str, str], Any] = {
    **{(m, n): v for m in ("builtins", "__builtin__") for n, v in _BUILTINS.items()},
    **{(m, "getattr"): member_by_name for m in ("builtins", "__builtin__")},
    ("_codecs", "encode"): _latin1,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("collections", "defaultdict"): _defaultdict,
    ("argparse", "Namespace"): types.SimpleNamespace,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    ("torch", "Tensor"): _TENSOR_TYPE,
    ("torch.nn.parameter", "Parameter"): _TENSOR_TYPE,
    **{("torch", n): StorageType(d) for n, d in _LEGACY_STORAGES.items()},
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): zero_stage,
    **{(q.rpartition(".")[0], q.rpartition(".")[2]): standin(q) for q in (*DEEPSPEED_CLASSES, *RECORD_CLASSES)},
}


def _returning(value: Any) -> Callable[[], Any]:
    return lambda: value


_LAZY: dict[tuple[str, str], Callable[[], Any]] = {
    **{
        (m, n): _returning(f)
        for m in ("numpy.core.multiarray", "numpy._core.multiarray")
        for n, f in (("_reconstruct", _np_reconstruct), ("scalar", _np_scalar))
    },
    ("numpy", "dtype"): lambda: _np_dtype,
    ("numpy", "ndarray"): lambda: _numpy().ndarray,
}


def user_allowed() -> set[str]:
    """Globals the user trusts, named exactly in `UCP_ALLOW_PICKLE` (comma-separated `module.Name`), less those this
    reader implements itself: trusting `builtins.getattr` must not replace the checked one with the real one."""
    named = {g.strip() for g in os.environ.get(ALLOW_ENV, "").split(",") if g.strip()}
    return {g for g in named if tuple(g.rsplit(".", 1)) not in _TABLE}


def _import_exact(module: str, name: str) -> Any:
    if "." in name or not name.isidentifier():
        _refuse(f"global name {name!r} is not one attribute")
    return getattr(importlib.import_module(module), name)


def hint(module: str, name: str) -> str:
    """What to say when a global is refused."""
    return (
        f"refusing to unpickle global '{module}.{name}'; if you trust this file, allow it with "
        f"{ALLOW_ENV}={module}.{name}"
    )


class SafeUnpickler(pickle._Unpickler):  # the pure-Python machine, whose opcodes can be replaced one by one
    """A pickle loader that runs no code named by the data (see the module docstring).

    `persistent_load` is the caller's: torch archives refer to tensor storages through it, and
    `extra` adds exact globals the caller implements itself (torch's tensor rebuild functions).
    """

    dispatch: ClassVar[dict[int, Any]] = dict(pickle._Unpickler.dispatch)
    # set by the pure-Python unpickler's load(); declared so the opcode handlers below type-check
    stack: list[Any]
    append: Callable[[Any], None]

    def __init__(
        self, data: bytes, persistent_load: Callable[[Any], Any], extra: dict[tuple[str, str], Any] | None = None
    ) -> None:
        super().__init__(io.BytesIO(data), encoding="ASCII")
        self._persistent = persistent_load
        self._extra = extra or {}
        self._callables: list[Any] = []  # identity list: every callable a global resolved to
        self._types: list[type] = []  # types NEWOBJ may construct and BUILD may fill in
        self._trusted = user_allowed()
        self._dtypes: dict[str, torch.dtype] | None = None

    def persistent_load(self, pid: Any) -> Any:
        return self._persistent(pid)

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key in self._extra:
            found = self._extra[key]
        elif key in _TABLE:
            found = _TABLE[key]
        elif key in _LAZY:
            found = _LAZY[key]()
        elif module == "torch" and name in self._torch_dtypes():
            found = self._torch_dtypes()[name]
        elif f"{module}.{name}" in self._trusted:
            found = _import_exact(module, name)
        else:
            raise UnsafePickle(hint(module, name))
        if isinstance(found, type):
            self._types.append(found)
        if callable(found):
            self._callables.append(found)
        return found

    def _torch_dtypes(self) -> dict[str, torch.dtype]:
        if self._dtypes is None:
            self._dtypes = _dtypes()
        return self._dtypes

    def _allowed_call(self, func: Any) -> bool:
        return any(func is c for c in self._callables)

    def _construct(self, cls: Any, args: Any, kwargs: Any = None) -> None:
        if not (isinstance(cls, type) and any(cls is t for t in self._types)) or type(args) is not tuple:
            _refuse(f"constructing {cls!r}")
        if kwargs:
            _refuse(f"constructing {cls.__name__} with keyword arguments")
        self.append(cls.__new__(cls, *args))

    def load_newobj(self) -> None:
        args = self.stack.pop()
        self._construct(self.stack.pop(), args)

    def load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        self._construct(self.stack.pop(), args, kwargs)

    def load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        if not self._allowed_call(func) or type(args) is not tuple:
            _refuse(f"calling {func!r}")
        self.stack[-1] = func(*args)

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        kind = type(inst)
        if isinstance(inst, PickledObject):
            object.__setattr__(inst, "state", state)
            return
        np = sys.modules.get("numpy")
        if np is not None and (kind is np.ndarray or isinstance(inst, np.dtype)):
            if isinstance(inst, np.dtype) and (inst.kind not in _NUMERIC or not _plain_dtype_state(state)):
                _refuse(f"setting state {state!r} on numpy dtype {inst}")
            inst.__setstate__(state)  # numpy checks its own state against the shape and dtype
            return
        plain = kind in (types.SimpleNamespace, collections.OrderedDict)
        if not plain and not any(kind is t for t in self._types if f"{t.__module__}.{t.__qualname__}" in self._trusted):
            _refuse(f"setting state on {kind.__name__}")
        if not plain and hasattr(inst, "__setstate__"):
            inst.__setstate__(state)
            return
        if isinstance(state, tuple) and len(state) == 2 and state[1] is None:
            state = state[0]
        if not isinstance(state, dict) or not all(type(k) is str for k in state):
            _refuse(f"state of {kind.__name__} is not a dict of names")
        inst.__dict__.update(state)

    def _refuse_opcode(self) -> None:
        _refuse("protocol-0/1 instantiation, extension codes and out-of-band buffers are not read")

    def load_persid(self) -> None:
        _refuse("text persistent ids are not read")


for _op, _method in (
    (pickle.NEWOBJ, SafeUnpickler.load_newobj),
    (pickle.NEWOBJ_EX, SafeUnpickler.load_newobj_ex),
    (pickle.REDUCE, SafeUnpickler.load_reduce),
    (pickle.BUILD, SafeUnpickler.load_build),
    (pickle.PERSID, SafeUnpickler.load_persid),
):
    SafeUnpickler.dispatch[_op[0]] = _method
for _op in (pickle.INST, pickle.OBJ, pickle.EXT1, pickle.EXT2, pickle.EXT4, pickle.NEXT_BUFFER, pickle.READONLY_BUFFER):
    SafeUnpickler.dispatch[_op[0]] = SafeUnpickler._refuse_opcode


def loads(data: bytes) -> Any:
    """Unpickle plain `data` safely (no tensor storages: persistent ids are refused)."""
    return SafeUnpickler(data, lambda pid: _refuse("persistent id without a tensor archive")).load()
