"""Analysis of bench results: diagnose (tail attribution), compare (A/B), plan (capacity)."""
