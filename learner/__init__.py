"""The learner: closed episodes in, identical credit assignment, a policy update, weights pushed out.

Not built yet: this package arrives with issue 5.
"""
