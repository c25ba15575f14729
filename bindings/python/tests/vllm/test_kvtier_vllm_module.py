"""kvtier.vllm as a module: only it imports vLLM, and the
``--kv-transfer-config`` files in examples/vllm name tiers vLLM can load."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_harness import require_vllm

require_vllm()

from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: E402
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager  # noqa: E402

EXAMPLES = sorted((Path(__file__).resolve().parents[4] / "examples" / "vllm").glob("*.json"))


def test_import_kvtier_does_not_import_vllm_but_kvtier_vllm_does():
    code = (
        "import sys, kvtier\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'vllm'], 'kvtier imported vllm'\n"
        "import kvtier.vllm\n"
        "assert 'vllm.v1.kv_offload.tiering.base' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_there_is_an_example_per_tier():
    names = {p.stem for p in EXAMPLES}
    assert {"disk", "redis", "redis-cluster", "s3"} <= names, names


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_each_example_loads_kvtier_tiers_through_vllms_factory(path):
    config = json.loads(path.read_text())
    assert config["kv_connector"] == "OffloadingConnector"
    extra = config["kv_connector_extra_config"]
    assert extra["spec_name"] == "TieringOffloadingSpec"
    for tier in extra["secondary_tiers"]:
        assert tier["module_path"] == "kvtier.vllm"
        cls = SecondaryTierFactory.get_tier_class(tier)
        assert issubclass(cls, SecondaryTierManager) and cls.__module__ == "kvtier.vllm"
