"""The SGLang worker backend (issue 16): SGLang in-process behind agentgate's worker protocol."""
