"""Tables a reader looks at beside the findings: the MFU timeline, the rank x step heatmap, the
recovery incidents and the self-check records."""
