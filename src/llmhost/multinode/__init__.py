"""One model spread over several hosts: the follower hosts' side (`llmhost follow`) and
the check that the hosts agree before they start (`llmhost nodecheck`). The head's side
is the backend's (its follower watch in llmhost.backend.watchdog)."""
