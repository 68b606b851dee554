"""Chat-template work: messages and segments rendered to token ids (both apps), tools in the
prompt and the grammar of constrained output, and model output parsed into tool calls."""
