"""The environment under which the tests and benchmarks run everything on this machine.

What the trainer itself gives a local Ray (loopback, no token auth, no usage reports) and its
vLLM engines (no usage reports, Hugging Face offline), plus W&B offline and quiet. The tests
need it because they start Ray themselves; tests/conftest.py exports it for the whole test
session and benchmarks/benchlib.py for every benchmark process (adding a Ray temp folder).
"""

from workers.engines import ENGINE_ENV
from workers.driver.cluster import LOCAL_RAY_ENV

LOCAL_ENV = {
    **LOCAL_RAY_ENV,
    **ENGINE_ENV,
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
}
