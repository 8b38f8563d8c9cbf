"""`locust -f loadtest/multiturn_locustfile.py --headless --host URL -u USERS -r USERS --run-time 60s`:
multi-turn chat over a shared system prompt (see dspark_loadtest/multiturn.py)."""

from dspark_loadtest.multiturn import MultiTurnChatUser

__all__ = ["MultiTurnChatUser"]
