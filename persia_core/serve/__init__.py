"""Online serving: ``persia serve``'s HTTP prediction server (``server``) and its request instances
(``instances``)."""
