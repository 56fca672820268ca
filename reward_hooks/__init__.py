"""Reward webhooks, reward jobs (rq) and the episode lifecycle.

Not built yet: this package arrives with issue 3. Until then the gateway records calls into open
rollouts and nothing closes them.
"""
