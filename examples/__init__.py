"""Examples that embed kvmgr (not part of the installed package)."""
