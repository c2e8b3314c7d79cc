"""Shared fixtures: offline environment, fast CPU settings, tiny models."""
from __future__ import annotations

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("OMP_NUM_THREADS", "1")  # subprocesses too: the config default `threads` follows it
os.environ.setdefault("COOLSD_CACHE", tempfile.mkdtemp(prefix="coolsd-test-cache-"))

import pytest  # noqa: E402
import torch  # noqa: E402

import coolsd.resolvers  # noqa: E402, F401  (the ${asset:} resolver)
from tests.helpers import tiny_llamagen  # noqa: E402


@pytest.fixture(autouse=True)
def _cpu_threads():
    """One torch thread in every test: the workers share the cores, and a test that runs the runner in-process
    sets ``eval.threads`` for the rest of its worker's tests (two busy-waiting OpenMP threads per worker on 2
    cores made the whole suite several times slower)."""
    torch.set_num_threads(1)
    yield


@pytest.fixture(scope="session")
def tiny_model():
    """The random-weight class-conditional LlamaGen of ``configs/model/tiny.yaml`` (float64, CFG 2)."""
    return tiny_llamagen(dtype="float64")


def pytest_report_header(config):
    """The start-up self-check on this machine, so the output says which invariance property the tests assert."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from coolsd.numerics import check_batch_invariance
    from tests.helpers import CONFIGS

    old = torch.get_num_threads()
    lines = []
    try:
        for row_block in (1, 4):
            with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
                model = instantiate(compose(config_name="config", overrides=[f"model.row_block={row_block}"]).model)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                check = check_batch_invariance(model)
                what = ("holds: the invariance tests assert bitwise equality" if check.batch_invariant else
                        f"fails (max relative logit difference {check.max_rel_diff:.1e}): the invariance tests "
                        "assert the weaker property")
                lines.append(f"batch-invariance self-check, model.row_block={row_block}, on {check.describe()}: {what}")
    finally:
        torch.set_num_threads(old)
    return lines


#: a test allowed this many seconds or more (``@pytest.mark.timeout``) starts first, so that under pytest-xdist it
#: runs beside the others instead of after them (the claims page's regeneration is most of the ``-m slow`` pass)
LONG_S = 1800


def pytest_collection_modifyitems(config, items):
    """The longest tests first (``LONG_S``); the rest keep their order."""
    def long(item) -> bool:
        marker = item.get_closest_marker("timeout")
        return bool(marker and marker.args and marker.args[0] >= LONG_S)
    items.sort(key=lambda item: not long(item))  # stable: False (long) sorts first
