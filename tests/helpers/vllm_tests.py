"""scripts/vllm_entrypoint_tests.py, loaded as a module (once): the scripts folder is not a
package."""

from __future__ import annotations

import functools
import importlib.util

from tests.conftest import REPO


@functools.cache
def script():
    path = REPO / "scripts" / "vllm_entrypoint_tests.py"
    spec = importlib.util.spec_from_file_location("vllm_entrypoint_tests", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
