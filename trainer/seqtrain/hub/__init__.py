"""Models from the Hugging Face hub: the downloader a job's init container runs (`seqtrain.hub.download`)."""

from seqtrain.hub.download import HubError, HubModel, download

__all__ = ["HubError", "HubModel", "download"]
