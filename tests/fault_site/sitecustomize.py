"""Run by Python at start-up where ``fault_injection.fault_env`` put this folder on
PYTHONPATH: installs the faults a test asked for in this process (tests/fault_injection.py)."""

from fault_injection import install_from_environment

install_from_environment()
