"""Precision policies written into the graph, and fidelity measurement against torch fp32."""
