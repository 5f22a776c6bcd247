"""A gang's objects as plain dicts (pure builders, pod template, hf:// init container, push token) and its pods read back."""
