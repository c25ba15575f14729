"""The package explains itself (issue 29, items 1 to 3): signatures with
types and defaults in the code, the stubs and the docstrings, held to the
Rust defaults; ``__version__``; mypy catching a misspelt keyword; a tier
checked when its manager is made; numeric keywords checked against their
ranges; one rule for a key of the wrong length."""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
import os
import pydoc
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import kvtier
from kvtier import _kvtier

from conftest import ReqContext, key, require_env, resolve

HERE = Path(__file__).resolve().parent
PACKAGE = Path(kvtier.__file__).resolve().parent
WORKSPACE = HERE.parents[2]

CLASSES = {
    "python": kvtier.AsyncLookupManager,
    "redis": kvtier.RedisLookupManager,
    "s3": kvtier.S3LookupManager,
    "disk": kvtier.DiskLookupManager,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stub_inits() -> dict[str, ast.FunctionDef]:
    """Each class's ``__init__`` in ``__init__.pyi``."""
    tree = ast.parse((PACKAGE / "__init__.pyi").read_text())
    inits = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    inits[node.name] = item
    return inits


def stub_params(fn: ast.FunctionDef) -> list[tuple[str, str, str, object]]:
    """(name, kind, annotation, default) of each parameter but self."""
    args = fn.args
    out = []
    positional = args.args[1:]
    pos_defaults = [inspect.Parameter.empty] * (len(positional) - len(args.defaults)) + [
        ast.literal_eval(d) for d in args.defaults
    ]
    for arg, default in zip(positional, pos_defaults):
        out.append((arg.arg, "POSITIONAL_OR_KEYWORD", ast.unparse(arg.annotation), default))
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        value = inspect.Parameter.empty if default is None else ast.literal_eval(default)
        out.append((arg.arg, "KEYWORD_ONLY", ast.unparse(arg.annotation), value))
    return out


def runtime_params(cls) -> list[tuple[str, str, str, object]]:
    sig = inspect.signature(cls.__init__)
    # Annotations are strings (``from __future__ import annotations``),
    # compared in ast.unparse's spelling.
    return [
        (p.name, p.kind.name, ast.unparse(ast.parse(p.annotation, mode="eval").body), p.default)
        for p in list(sig.parameters.values())[1:]
    ]


def doc_default(value) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


@pytest.mark.parametrize("kind", sorted(CLASSES))
def test_each_class_has_one_explicit_signature_in_code_stubs_and_docstring(kind):
    cls = CLASSES[kind]
    params = runtime_params(cls)
    # The code and the stubs agree: names, kinds, annotations, defaults.
    assert params == stub_params(stub_inits()[cls.__name__])
    assert not any(kind_ in ("VAR_KEYWORD", "VAR_POSITIONAL") for _, kind_, _, _ in params)
    # help() shows the signature, and the docstring has one line per keyword
    # with its type and default.
    text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    assert "call_timeout_ms: 'int' = 1000" in text or "call_timeout_ms: int = 1000" in text
    doc = inspect.getdoc(cls)
    for name, _, _, default in params:
        lines = [line for line in doc.splitlines() if line.startswith(f"{name}: ")]
        assert len(lines) == 1, f"{cls.__name__} docstring: one line for {name}"
        if default is not inspect.Parameter.empty:
            assert f"= {doc_default(default)} " in lines[0], lines[0]


@pytest.mark.parametrize("kind", sorted(CLASSES))
def test_the_signatures_defaults_are_the_rust_defaults(kind):
    rust = _kvtier._defaults(kind)
    params = {name: default for name, _, _, default in runtime_params(CLASSES[kind])}
    params.pop("check", None)
    params.pop("tier_type", None)
    # Every field of the Rust configuration is a keyword, and no other.
    assert set(params) == set(rust)
    # Where Python says "unset" or "required", the native side decides.
    python_only = {
        "tier_name": (None, "tier"),  # None: the tier's type
        "url": (None, "redis://127.0.0.1:6379/"),  # required from Python
        "bucket": (inspect.Parameter.empty, ""),  # required
        "path": (inspect.Parameter.empty, ""),  # required
    }
    for name, default in params.items():
        if name in python_only:
            assert (default, rust[name]) == python_only[name], name
        elif isinstance(default, tuple):
            assert list(default) == rust[name], name
        else:
            assert default == rust[name], name


def test_store_load_and_remove_are_documented_where_they_are_defined():
    for cls in (kvtier.RedisLookupManager, kvtier.S3LookupManager, kvtier.DiskLookupManager):
        for name, args in (("store", ["key", "data"]), ("load", ["key"]), ("remove", ["key"])):
            method = getattr(cls, name)
            assert method.__name__ == name
            assert inspect.getdoc(method), f"{cls.__name__}.{name} has no docstring"
            assert list(inspect.signature(method).parameters) == ["self", *args]
        text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
        # The private native method never shows (submit_store is another method).
        assert not re.search(r"(?<![a-z])_store\(", text)
        assert "store(self, key: 'bytes', data: 'bytes')" in text
    assert not hasattr(kvtier.AsyncLookupManager, "store")


def test_version_is_the_package_and_cargo_version():
    cargo = (WORKSPACE / "Cargo.toml").read_text()
    match = re.search(r'^\[workspace\.package\][^\[]*?^version = "([^"]+)"', cargo, re.M | re.S)
    assert match, "no version in the workspace's Cargo.toml"
    assert kvtier.__version__ == match.group(1)
    assert kvtier.__version__ == importlib.metadata.version("kvtier")
    assert "__version__" in kvtier.__all__


def run_mypy(tmp_path: Path, source: str) -> subprocess.CompletedProcess:
    pytest.importorskip("mypy", reason="mypy is not installed (test.sh installs it on CPython >= 3.10)")
    snippet = tmp_path / "snippet.py"
    snippet.write_text(source)
    env = dict(os.environ)
    # An editable install (maturin develop) is found through MYPYPATH; an
    # installed wheel in site-packages as any installed package (mypy
    # refuses site-packages in MYPYPATH).
    if PACKAGE.parent.name not in ("site-packages", "dist-packages"):
        env["MYPYPATH"] = str(PACKAGE.parent)
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--strict", str(snippet)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )


def test_mypy_catches_a_misspelt_keyword_and_accepts_the_documented_calls(tmp_path):
    bad = run_mypy(tmp_path, 'import kvtier\nkvtier.RedisLookupManager(uri="redis://127.0.0.1:6379/")\n')
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert 'Unexpected keyword argument "uri" for "RedisLookupManager"' in bad.stdout, bad.stdout
    good = run_mypy(tmp_path, """\
import pathlib
from dataclasses import dataclass

import kvtier

@dataclass
class Ctx:
    req_id: str

class Memory(kvtier.AsyncLookupManager):
    def __init__(self) -> None:
        super().__init__("memory", call_timeout_ms=500)

    def batch_lookup(self, keys: list[bytes], req_context: object) -> list[bool]:
        return [False for _ in keys]

redis = kvtier.RedisLookupManager(url="redis://127.0.0.1:6379/", key_prefix="p:", check=False)
disk = kvtier.DiskLookupManager(path=pathlib.Path("/tmp/x"), fsync="never", key_len=36)
s3 = kvtier.S3LookupManager(bucket="b", endpoint="http://127.0.0.1:9000", force_path_style=True)
found: bool | None = redis.lookup(b"k", Ctx("r"))
data: bytes | None = disk.load(b"k")
disk.store(b"k", b"v")
version: str = kvtier.__version__
stack = kvtier.TierStack([Memory(), redis, disk, s3])
""")
    assert good.returncode == 0, good.stdout + good.stderr


def constructor(kind: str, tmp_path: Path):
    """Makes a `kind` manager with `**extra` keywords; no server is asked
    (the ranges are checked before anything is built)."""
    if kind == "python":
        return lambda **extra: kvtier.AsyncLookupManager("memory", **extra)
    if kind == "redis":
        return lambda **extra: kvtier.RedisLookupManager(url="redis://127.0.0.1:1/", check=False, **extra)
    if kind == "s3":
        return lambda **extra: kvtier.S3LookupManager(bucket="b", check=False, **extra)
    return lambda **extra: kvtier.DiskLookupManager(path=tmp_path / "d", **extra)


@pytest.mark.parametrize("kind", sorted(CLASSES))
def test_every_numeric_keyword_out_of_range_is_a_value_error_naming_field_and_range(kind, tmp_path):
    ranges = _kvtier._ranges(kind)
    ints = {name for name, _, annotation, _ in runtime_params(CLASSES[kind])
            if annotation in ("int", "int | None")}
    assert ints == set(ranges), "every int keyword has a range"
    make = constructor(kind, tmp_path)
    for field, (low, high) in ranges.items():
        for value in (low - 1, high + 1, -(2**70)):
            with pytest.raises(ValueError) as err:
                make(**{field: value})
            message = str(err.value)
            assert f"`{field}`" in message and f"from {low} to {high}" in message, message
            assert str(value) in message


def test_a_negative_timeout_names_the_field_and_the_range():
    with pytest.raises(ValueError, match=r"`call_timeout_ms`: must be an integer from 1 to 3153600000000, not -1"):
        kvtier.AsyncLookupManager("memory", call_timeout_ms=-1)


def test_a_redis_manager_needs_a_url_or_cluster_urls():
    for extra in ({}, {"check": False}, {"cluster_urls": []}):
        with pytest.raises(ValueError, match=r"needs url= .* or cluster_urls="):
            kvtier.RedisLookupManager(**extra)


def test_a_manager_checks_its_tier_when_made_and_raises_the_typed_error(tmp_path):
    (url,) = require_env("KVTIER_REDIS_URL")
    down = f"redis://127.0.0.1:{free_port()}/"
    with pytest.raises(kvtier.TierConnectionError, match=r"redis tier's start-up check \(PING"):
        kvtier.RedisLookupManager(url=down, connect_timeout_ms=200, response_timeout_ms=200)
    with pytest.raises(kvtier.TierConfigError, match=r"redis tier's start-up check") as err:
        kvtier.RedisLookupManager(url=url, username="nobody", password="wrong-secret")
    assert "wrong-secret" not in str(err.value)
    # check=False: made while the server is down; lookups answer False.
    m = kvtier.RedisLookupManager(url=down, check=False, connect_timeout_ms=200,
                                  response_timeout_ms=200)
    try:
        assert resolve(m, key(1), ReqContext("r")) is False
    finally:
        m.shutdown()
    # A directory that cannot be one.
    not_a_dir = tmp_path / "file"
    not_a_dir.write_bytes(b"")
    with pytest.raises(kvtier.TierError, match=r"disk tier's start-up check") as err:
        kvtier.DiskLookupManager(path=not_a_dir / "tier")
    assert str(not_a_dir) in str(err.value)


def test_an_s3_manager_checks_its_bucket_when_made(tmp_path):
    endpoint, bucket = require_env("KVTIER_S3_ENDPOINT", "KVTIER_S3_BUCKET")
    with pytest.raises(kvtier.TierConfigError, match=r"s3 tier's start-up check \(HeadBucket"):
        kvtier.S3LookupManager(bucket="kvtier-no-such-bucket", endpoint=endpoint,
                               force_path_style=True, max_attempts=1)
    down = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(kvtier.TierConnectionError, match=r"s3 tier's start-up check"):
        kvtier.S3LookupManager(bucket=bucket, endpoint=down, force_path_style=True,
                               access_key_id="a", secret_access_key="b", max_attempts=1,
                               connect_timeout_ms=200, request_timeout_ms=300)
    m = kvtier.S3LookupManager(bucket=bucket, endpoint=down, force_path_style=True,
                               access_key_id="a", secret_access_key="b", check=False)
    m.shutdown()
    good = kvtier.S3LookupManager(bucket=bucket, endpoint=endpoint, force_path_style=True)
    good.shutdown()


def test_a_disk_key_of_the_wrong_length_is_a_value_error_at_every_call(tmp_path):
    m = kvtier.DiskLookupManager(path=tmp_path / "d", fsync="never")
    ctx = ReqContext("r")
    short = b"short"
    calls = {
        "lookup": lambda: m.lookup(short, ctx),
        "lookup_many": lambda: m.lookup_many([key(1), short], ctx),
        "lookup_prefix": lambda: m.lookup_prefix([key(1), short], ctx),
        "store": lambda: m.store(short, b"x"),
        "load": lambda: m.load(short),
        "remove": lambda: m.remove(short),
    }
    try:
        for name, call in calls.items():
            with pytest.raises(ValueError, match="invalid key of 5 bytes: keys must be 36 bytes long") as err:
                call()
            # One rule: a plain ValueError, not a tier's failure.
            assert not isinstance(err.value, kvtier.TierError), name
        assert m.stats()["errors"] == 0
        m.store(key(1), b"x")
        assert m.load(key(1)) == b"x"
    finally:
        m.shutdown()
