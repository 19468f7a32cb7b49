"""tensordict (and the ``torch._dynamo`` it imports: ~1.2 s) loads only where a TensorDict is built: the
services that never build one do not pay it at every start, and importing the SDK does not either."""

from __future__ import annotations

import subprocess
import sys

CHECK = "import sys\n{imports}\nprint('tensordict' in sys.modules, 'torch._dynamo' in sys.modules)\n"
WITHOUT = ("import rlfleet.services.collector.service, rlfleet.services.reward.service, "
           "rlfleet.services.reference.service, rlfleet.services.environment.service\n"
           "import rlfleet.services.common.diagnostics, rlfleet.services.common.interceptors, "
           "rlfleet.services.common.security, rlfleet.services.common.tracing\n"  # what serve() imports
           "import rlfleet.client, rlfleet.wire")


def loaded(imports: str) -> str:
    return subprocess.run([sys.executable, "-c", CHECK.format(imports=imports)], capture_output=True, text=True,
                          check=True, timeout=300).stdout.split("\n")[-2]


def test_services_without_tensordicts_and_the_sdk_import_without_it():
    assert loaded(WITHOUT) == "False False"
    assert loaded("from rlfleet.wire import decode_tensordict") == "True True"  # the control: its first use
