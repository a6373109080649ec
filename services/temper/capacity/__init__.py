"""Capacity planning: a step-time model of a job on a cluster (``model``), calibrated on measured runs
(``calibrate``); ``temper capacity`` is its command."""
