"""Training harness: a GPT under DP, ZeRO, TP(+SP), PP and their combinations."""
