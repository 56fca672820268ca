"""The learner: closed episodes in, identical credit assignment, an OpenRLHF policy update, weights out.

Modules, in the order the data flows: `collect` (task groups from the closed-episode stream), `credit`
(returns per call), `advantages` (group-relative, OpenRLHF's estimators), `transitions` (filters and
credited calls), `samples` (transition or trajectory samples, micro-batches), `policy` (OpenRLHF's Actor
and PolicyLoss), `push` (LoRA adapters to the inference servers, the policy pointer), `checkpoint`,
`ranks` (data-parallel ranks: who does what, the collectives), and `loop`, the training loop that reads
top to bottom. Heavy imports (torch, OpenRLHF) happen in those
modules, not here, so `learner.settings` stays light for the CLI.
"""

from learner.settings import LearnerSettings

__all__ = ["LearnerSettings"]
