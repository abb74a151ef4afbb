"""The request path: configs, the engine loop, the pure-Python scheduler and KV block manager, the plan
a step carries to its runner, and the executors that hand it over. config.py and plan.py import no torch,
so deploy/ and the tuner read them on hosts without it."""
