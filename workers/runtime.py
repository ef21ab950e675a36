"""The runtime as the comlrl trainer sees it: the names it may call, and nothing else.

`comlrl/` sits below `workers/` (the actors import its config, math and checkpoint format),
so the trainer imports this one module, and only inside the methods that start Ray work:
`import comlrl` stays free of the runtime, and no other module of `comlrl/` reaches upward.
"""

from __future__ import annotations

from workers.driver.actors import save_models
from workers.driver.cluster import WARM_ACTORS
from workers.driver.session import Session
from workers.ray_calls import ActorFailure, ray_get
from workers.roles.learner import OPTIMIZER_FILE, RNG_FILE

__all__ = ["ActorFailure", "OPTIMIZER_FILE", "RNG_FILE", "Session", "WARM_ACTORS", "ray_get",
           "save_models"]
