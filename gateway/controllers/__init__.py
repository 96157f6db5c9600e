"""HTTP controllers, one per resource; ``gateway.app.create_app`` lists them."""
