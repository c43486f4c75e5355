"""ftjob.data"""
