"""Routing policies for schedulers: pick the node for a prompt (docs/routing.md).

`cost` (the cost model), `load` (a backend's load from in-flight counts and the
engine's own gauges) and `policy` (the policies) are pure; the only I/O is
`directory_source.DirectorySource`, which reads prefix holders from the
directory in batches.
"""

from kvdir.routing.cost import (
    DEFAULT_LINKS,
    LLAMA3_8B,
    LLAMA_70B,
    SHAPES,
    CostModel,
    Link,
    ModelShape,
    PrefillFit,
    PullPlan,
    fit_prefill,
)
from kvdir.routing.load import DEFAULT_WEIGHTS, EngineLoad, LoadWeights, backend_load
from kvdir.routing.policy import (
    Balance,
    Candidate,
    Decision,
    Holder,
    Policy,
    Prompt,
    Router,
    Rule,
    Score,
    score,
)

__all__ = [
    "DEFAULT_LINKS",
    "DEFAULT_WEIGHTS",
    "LLAMA3_8B",
    "LLAMA_70B",
    "SHAPES",
    "Balance",
    "Candidate",
    "CostModel",
    "Decision",
    "EngineLoad",
    "Holder",
    "Link",
    "LoadWeights",
    "ModelShape",
    "Policy",
    "PrefillFit",
    "Prompt",
    "PullPlan",
    "Router",
    "Rule",
    "Score",
    "backend_load",
    "fit_prefill",
    "score",
]
