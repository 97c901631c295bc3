"""Graph passes over ATen FX graphs: sharding rules, propagation, cost model, lowering to local
ops + functional collectives, and the hand-off to Inductor."""
