"""A test-only stand-in for PyTorch: NOT torch, and never shipped.

kvtier's vLLM tests import vLLM 0.34.0, and ``import vllm`` imports torch
first. The package index has only CUDA builds of torch (29 packages, about
5 GB installed), while the code those tests drive (vLLM's tiering manager,
its CPU primary tier over a numpy-backed view, its tier factory and tiers)
moves bytes through memoryviews and numpy only. ``bindings/python/vllm-env.sh``
therefore puts this directory on the vLLM test venv's path instead of
installing torch, unless it is run with ``--real-torch``.

How it stays honest:

* Every ``torch.X`` and ``torch.sub.module.X`` name exists as an inert
  placeholder class, so the annotations, base classes, dictionary keys and
  ``isinstance`` checks (always false) of vLLM, transformers and xgrammar
  import: about 200 names in 40 submodules while they import. dtypes carry
  their ``itemsize``.
* Calling a placeholder raises :class:`TorchStandinError` naming it, so a
  test that reaches real torch behaviour fails loudly instead of computing
  with a fake.
* The calls those packages make while they import are listed in
  ``_IMPORT_TIME`` below; each answers as a torch without any accelerator
  would (``is_available()`` is false) or does nothing (compile and graph
  decorators return the function; custom-op registration goes into a library
  that never dispatches). ``torch.tensor`` returns a value that raises on
  any use.
"""

from __future__ import annotations

import importlib.abc as _abc
import importlib.machinery as _machinery
import os as _os
import sys as _sys
import types as _types
from typing import Any as _Any
from typing import Callable as _Callable

__version__ = "2.14.0"


class TorchStandinError(RuntimeError):
    """Real torch behaviour was asked of the stand-in."""


def _refuse(name: str) -> TorchStandinError:
    return TorchStandinError(
        f"{name} needs real torch; this is kvtier's test-only stand-in "
        "(bindings/python/tests/vllm/torch_standin). Build the venv with "
        "`vllm-env.sh --real-torch` to run code that uses torch."
    )


class _Placeholder(type):
    """Metaclass of the inert stand-ins for torch's names."""

    def __getattr__(cls, name: str) -> _Any:
        if name.startswith("__") or cls.__dict__.get("_subclassed", True):
            raise AttributeError(name)
        return _resolve(cls.__qualname__, name)

    def __call__(cls, *args: _Any, **kwargs: _Any) -> _Any:
        if cls.__dict__.get("_subclassed", False):
            return super().__call__(*args, **kwargs)
        raise _refuse(f"{cls.__qualname__}()")

    def __getitem__(cls, item: _Any) -> _Any:
        return cls

    def __or__(cls, other: _Any) -> _Any:
        return _Any

    __ror__ = __or__


class _Inert(metaclass=_Placeholder):
    """Base of every placeholder; subclasses defined by importers may be
    instantiated (transformers builds ``nn.Module`` subclasses at import)."""

    def __init_subclass__(cls, **kwargs: _Any) -> None:
        cls._subclassed = True

    def __init__(self, *args: _Any, **kwargs: _Any) -> None:
        pass


_PLACEHOLDERS: dict[str, type] = {}


def _placeholder(qualname: str) -> type:
    found = _PLACEHOLDERS.get(qualname)
    if found is None:
        found = _Placeholder(qualname.rsplit(".", 1)[-1], (_Inert,), {})
        found._subclassed = False
        found.__qualname__ = qualname
        found.__module__ = qualname.rsplit(".", 1)[0]
        _PLACEHOLDERS[qualname] = found
    return found


class _Unusable:
    """A value computed at import time (``torch.tensor(-1)``) that refuses use."""

    def __init__(self, what: str) -> None:
        object.__setattr__(self, "_what", what)

    def __getattr__(self, name: str) -> _Any:
        raise _refuse(f"{self._what}.{name}")

    def __repr__(self) -> str:
        return f"<torch stand-in: {self._what}>"


class _NoOpContext:
    """``no_grad()``: there is no autograd to switch off."""

    def __init__(self, *args: _Any, **kwargs: _Any) -> None:
        pass

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: _Any) -> None:
        return None

    def __call__(self, fn: _Callable) -> _Callable:
        return fn


def _decorator(*args: _Any, **kwargs: _Any) -> _Any:
    """``torch.compile(fn)`` and ``torch.compile(**options)(fn)``: fn, unchanged."""
    if args and callable(args[0]):
        return args[0]
    return lambda fn: fn


def _false(*args: _Any, **kwargs: _Any) -> bool:
    return False


def _nothing(*args: _Any, **kwargs: _Any) -> None:
    return None


class _Library:
    """``torch.library.Library``: records nothing and never dispatches."""

    def __init__(self, ns: str, kind: str, *args: _Any, **kwargs: _Any) -> None:
        self.ns = ns

    define = impl = _register_fake = _nothing


class _Device:
    """``torch.device("cpu")``: a device is only its name here."""

    def __init__(self, type: str, index: int | None = None) -> None:
        self.type, _, given = str(type).partition(":")
        self.index = int(given) if given else index

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"

    __repr__ = __str__

    def __eq__(self, other: object) -> bool:
        return str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))


class _Finfo:
    """``torch.finfo(dtype)``, for the one dtype importers ask about."""

    _LIMITS = {"float8_e4m3fn": 448.0}

    def __init__(self, dtype: _Any) -> None:
        name = getattr(dtype, "__name__", str(dtype))
        if name not in self._LIMITS:
            raise _refuse(f"torch.finfo({name})")
        self.max = self._LIMITS[name]
        self.min = -self.max


# What vLLM 0.34.0, transformers and xgrammar call while they import.
_IMPORT_TIME: dict[str, _Any] = {
    "torch.device": _Device,
    "torch.tensor": lambda *a, **k: _Unusable("torch.tensor(...)"),
    "torch.finfo": _Finfo,
    "torch.no_grad": _NoOpContext,
    "torch.compile": _decorator,
    "torch.compiler.is_compiling": _false,
    "torch.compiler.disable": _decorator,
    "torch.compiler.allow_in_graph": _decorator,
    "torch._dynamo.allow_in_graph": _decorator,
    "torch._dynamo.assume_constant_result": _decorator,
    "torch.library.Library": _Library,
    "torch.library.infer_schema": lambda *a, **k: "() -> ()",
    "torch.library.register_fake": _decorator,
    "torch.library.custom_op": _decorator,
    "torch.library.register_autograd": _nothing,
    "torch._library.opaque_object.register_opaque_type": _nothing,
    "torch.utils._pytree.register_pytree_node": _nothing,
    "torch.cuda.is_available": _false,
    "torch.xpu.is_available": _false,
    "torch.backends.mps.is_available": _false,
    "torch.backends.mps.is_built": _false,
    "torch.accelerator.current_accelerator": _nothing,
    "torch.distributed.is_available": _false,
    "torch.distributed.is_initialized": _false,
    "torch.distributed.is_xccl_available": _false,
}

# dtypes: one placeholder per dtype, aliases shared as in torch.
_ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "uint32": 4,
    "int32": 4, "uint64": 8, "int64": 8, "float16": 2, "bfloat16": 2,
    "float32": 4, "float64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1,
}
_ALIASES = {"half": "float16", "float": "float32", "double": "float64",
            "long": "int64", "int": "int32", "short": "int16"}


def _resolve(parent: str, name: str) -> _Any:
    """``parent.name``: an import-time call, a dtype, or a placeholder."""
    qualname = f"{parent}.{name}"
    value = _IMPORT_TIME.get(qualname)
    if value is None and parent == "torch":
        if name in _ALIASES:
            return _resolve(parent, _ALIASES[name])
        if name in _ITEMSIZE:
            value = _placeholder(qualname)
            value.itemsize = _ITEMSIZE[name]
    return value if value is not None else _placeholder(qualname)


class _Module(_types.ModuleType):
    def __getattr__(self, name: str) -> _Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _resolve(self.__name__, name)
        setattr(self, name, value)
        return value


class _Finder(_abc.MetaPathFinder, _abc.Loader):
    """Serves every ``torch.*`` submodule as a stand-in module."""

    def find_spec(self, fullname: str, path: _Any, target: _Any = None) -> _Any:
        if fullname.startswith("torch."):
            return _machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: _Any) -> _types.ModuleType:
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: _types.ModuleType) -> None:
        return None


_sys.meta_path.insert(0, _Finder())
# apache-tvm-ffi (under xgrammar) would otherwise try to compile a DLPack
# bridge against torch in a subprocess at every import; there is none here.
_os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")
_self = _sys.modules[__name__]
_self.__class__ = _Module
