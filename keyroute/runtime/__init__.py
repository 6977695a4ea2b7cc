"""Runtime: what every process has: settings, logs, metrics, small concurrency helpers, and what the
compiled build needs said in the source.
"""
