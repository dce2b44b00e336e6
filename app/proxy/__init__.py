"""The drop-in proxy (docs/guides/proxy.md): a caller's request waits in its endpoint's line as a
task of type `proxy`, then this process calls the upstream and streams the answer back."""
