"""Ollama's API (`/api/chat`, `/api/generate`, `/api/tags`, ...), an adapter onto the chat endpoint's engine path."""
