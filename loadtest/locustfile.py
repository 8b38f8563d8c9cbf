"""`locust -f loadtest/locustfile.py --tier NAME ...` from a checkout; see dspark_loadtest/locustfile.py."""

from dspark_loadtest.locustfile import OpenAIStreamUser, TierShape

__all__ = ["OpenAIStreamUser", "TierShape"]
