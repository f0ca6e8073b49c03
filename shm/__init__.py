"""Where weights live: topology, plan, segments, expert store, checkpoint sources.

Imports nothing else of the project.
"""
