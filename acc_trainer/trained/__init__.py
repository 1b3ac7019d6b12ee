"""trained"""
