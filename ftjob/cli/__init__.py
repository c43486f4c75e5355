"""ftjob.cli"""
