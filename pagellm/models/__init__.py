"""Model families: one file each, built from pagellm/layers; `registry` maps Hugging Face
`architectures` names and GGUF `general.architecture` values to them."""
