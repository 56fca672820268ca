"""Reward webhooks, reward jobs (rq) and the sweeper: how episodes get their rewards and close.

- `routes`: the webhook routes the gateway serves (`/rollouts/{id}/reward`, `/calls/{i}/reward`, `/finish`,
  `/fail`), each behind one check, `auth.WebhookAuth` (signatures: `signing`; docs/security.md).
- `queue` and `jobs`: reward jobs, run by `rlgate worker`, scoring an episode with a function of `rewards`.
- `limits`: the range every reward must lie in; `sweeper`: expiry and outbox repair; `client`: a
  standard-library client for harnesses.
"""
