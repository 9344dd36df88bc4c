"""Data: prompt sets (built-in, ShareGPT, HumanEval) and a tolerant JSON record reader."""
