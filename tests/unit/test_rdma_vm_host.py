"""The rdma tier's VM harness reports why it cannot run, instead of passing silently."""

from __future__ import annotations

import shutil

import pytest

from tests.rdma import vm


def test_missing_host_tools_are_named_with_their_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda _name: None)
    with pytest.raises(vm.VmError, match=r"missing host tools: qemu-system-x86_64.*mmdebstrap"):
        vm.check_host()


def test_guest_sees_the_repository_and_python_read_only() -> None:
    shared = dict(vm.shares())
    assert str(vm.REPO_ROOT) in shared and all(shared.values())
    env = vm.guest_env()
    assert env["KVDIR_IN_VM"] == "1" and "/opt/kvdir-py" in env["PYTHONPATH"]
