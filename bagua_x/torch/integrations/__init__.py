"""bagua_x inside other tools' APIs: DDP's comm hook, Lightning's strategy, Bagua's tensor methods, DDP's keywords."""
