"""Probe documents, pure: ``document`` (``gputopo/probe/v1`` JSON and Markdown) and ``nodes`` (the
across-nodes sections).
"""
