"""pdplan, the planner (named so that no other distribution claims the name): node profiles
(profile.py, measured by profiler.py), a discrete-event simulator of the router and the pools
(simulation.py and the pieces it drives), the search for pool sizes (planner.py) and the live
autoscaler. Imports nothing heavy: each piece loads what it needs."""
