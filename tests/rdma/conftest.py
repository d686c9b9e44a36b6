"""The rdma tier: `guest/` runs only inside the Soft-RoCE VM (KVDIR_IN_VM=1);
on the host, test_vm.py boots the VM and runs it there."""

from __future__ import annotations

import os

collect_ignore = [] if os.environ.get("KVDIR_IN_VM") == "1" else ["guest"]
