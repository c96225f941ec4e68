"""The 4-D MoE scaling law L(N_tot, S, D, G): laws, fitter, bootstrap, bundled fit."""
