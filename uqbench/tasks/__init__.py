"""Tasks turn a method's outputs into saved predictions and metrics.

A task is built by Hydra from ``conf/task/<name>.yaml``; each dataset config selects the task it
is scored with, and the runner checks that the data agrees (``task.name == data.task``).
"""
