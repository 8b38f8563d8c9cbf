"""Locust entry point for DSpark Serve SLA scenarios: `locust -f loadtest/locustfile.py --tier NAME ...`.

The users, the tier's load shape and the SLA evaluation live in `dspark_loadtest.locust_plugin`;
`dspark loadtest run` drives this file headless.
"""

from dspark_loadtest.locust_plugin import OpenAIStreamUser, TierShape

__all__ = ["OpenAIStreamUser", "TierShape"]
