"""The test device switch.

    python -m pytest                          # the CPU, as CI runs it
    FB_TEST_DEVICE=cuda python -m pytest      # every single-process test on the GPU
    python -m pytest --device cuda            # the same

On a device other than the CPU the switch makes it torch's default device for the whole run, so
the models, batches and tensors each test builds (and torch.optim's reference run beside them)
live there, and turns off TF32 and cuDNN's nondeterministic kernels, so that bit-for-bit tests
compare the same arithmetic. Tests that only make sense on the CPU (spawned gloo ranks, the
examples and README run as CPU programs, CPU allocator behaviour) carry ``@pytest.mark.cpu_only(
"why")`` and are reported as skipped with that reason; CUDA's own multi-rank paths are in
``test_cuda_distributed.py``.
"""

from __future__ import annotations

import os

import pytest
import torch


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        default=None,
        help="the device the tests run on: cpu (default) or cuda; the same as FB_TEST_DEVICE",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cpu_only(reason): a test that only makes sense on the CPU (say why)")
    for plugin, marker in (
        ("timeout", "timeout(seconds): pytest-timeout's limit"),
        ("xdist", "xdist_group(name): one worker"),
    ):
        if not config.pluginmanager.hasplugin(plugin):  # markers of optional plugins, known without them
            config.addinivalue_line("markers", marker)
    device = config.getoption("--device") or os.environ.get("FB_TEST_DEVICE", "cpu")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"--device {device}: torch {torch.__version__} sees no CUDA device here")
    os.environ["FB_TEST_DEVICE"] = device  # for tests/devices.py, imported while collecting
    from devices import use_device  # reads FB_TEST_DEVICE, set just above

    use_device(torch.device(device))


def pytest_report_header(config: pytest.Config) -> str:
    device = torch.device(os.environ["FB_TEST_DEVICE"])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    return f"test device: {device} ({name}), torch {torch.__version__}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.device(os.environ["FB_TEST_DEVICE"]).type == "cpu":
        return
    for item in items:
        marker = item.get_closest_marker("cpu_only")
        if marker is not None:
            reason = marker.args[0] if marker.args else marker.kwargs.get("reason", "")
            if not reason:
                raise pytest.UsageError(f"{item.nodeid}: cpu_only needs a reason")
            item.add_marker(pytest.mark.skip(reason=f"CPU only: {reason}"))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With ``FB_TEST_FAILURES=FILE``, each failure's traceback is appended to FILE as it happens
    (the prepared GPU run reads it: a run stopped at its time limit still shows why tests failed).
    Under pytest-xdist the controller writes it, once per failure."""
    path = os.environ.get("FB_TEST_FAILURES")
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    with open(path, "a") as f:
        f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
